"""The auxiliary CUDA stream that CP communication runs on (:func:`cp_stream`)."""
from __future__ import annotations

import threading
from typing import Optional, Union

import torch

__all__ = ["cp_stream"]

_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_LOCK = threading.Lock()


def cp_stream(device: Optional[Union[int, str, torch.device]] = None) -> Optional["torch.cuda.Stream"]:
    """The auxiliary CUDA stream for CP communication on ``device``; ``None`` when the device is not CUDA.

    Created lazily on first use, on that device, and cached per device for the life of the process, so every
    CP size — including a group bound at runtime on a model built without CP — finds a stream (TE otherwise fails
    with ``'NoneType' object has no attribute 'wait_event'``).

    Args:
        device: a CUDA device (index, ``"cuda:1"``, ``torch.device``); default: the current CUDA device if CUDA is
            available, else ``None`` is returned. A CPU device returns ``None``.

    Raises:
        RuntimeError: the first call for a device happens during CUDA graph capture (create it before capturing:
            call ``cp_stream()`` once at start-up).

    Example::

        s = cpscope.cp_stream()          # None on a CPU-only machine
        if s is not None:
            s.wait_stream(torch.cuda.current_stream())
    """
    if device is None:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is not None:
        return stream
    with _LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"cp_stream(cuda:{index}) was first requested during CUDA graph capture; call cpscope.cp_stream() "
                    "once before capturing so the stream exists outside the graph"
                )
            with torch.cuda.device(index):
                stream = torch.cuda.Stream(device=index)
            _STREAMS[index] = stream
    return stream
