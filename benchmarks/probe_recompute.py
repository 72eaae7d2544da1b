"""What a non-reentrant torch checkpoint's recompute sees on CUDA (graph task id, bound marker, the read check)."""
import threading, torch, torch.utils.checkpoint as tuc
import cpscope
from cpscope import scope as sc
main = threading.get_ident()
S2 = sc.CPScope(object(), 2, 1)
def fn(t):
    where = "main" if threading.get_ident() == main else "other-thread"
    try:
        n = cpscope.cp_size()
        print(where, "read ok", n, "task", sc._current_graph_task_id(), "bound", sc._BOUND_IN_TASK.get(),
              "active", sc._ACTIVE.get(), flush=True)
    except Exception as e:
        print(where, "raised", type(e).__name__, flush=True)
        raise
    return t.sin() * n
for dev in ("cpu", "cuda"):
    x = torch.linspace(0.1, 1.0, 8, device=dev, requires_grad=True)
    with S2.bind():
        y = tuc.checkpoint(fn, x, use_reentrant=False)
        print(dev, "backward:", flush=True)
        try:
            y.sum().backward()
            print(dev, "backward returned")
        except Exception as e:
            print(dev, "backward raised", type(e).__name__, str(e)[:100])
