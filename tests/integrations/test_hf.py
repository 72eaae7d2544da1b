"""transformers decoder under ``attn_implementation="cpscope"`` vs. a float64 eager reference on the full sequence.

Every rank builds the same random-weight Llama (GQA, RoPE) and the same batch, runs the reference itself on the full
sequence, and checks its local logits (cut with the test's own zigzag index math) and the CP-group sum of its weight
gradients. Every attention layer of both models uses a non-default scale (``SCALING``), so a ``softmax_scale`` that
does not reach the ring (e.g. the default ``1/sqrt(d)``) fails the comparisons.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.recompute import scope_context_fn  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from tests.attention._reference import zigzag_index  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

VOCAB, SEQ = 128, 32
DOCS = [8, 16, 8]  # packed case: every document divisible by 2*cp for cp <= 4
SCALING = 0.37  # attention scale of every layer; the default would be 1/sqrt(head_dim) = 0.25


def _config(family: str = "llama"):
    common = dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.0,
    )
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**common)
    if family == "mistral":  # sliding_window longer than the sequence: accepted, no effect
        return transformers.MistralConfig(sliding_window=SEQ, **common)
    return transformers.LlamaConfig(**common)


def _models(family: str = "llama"):
    """(cpscope model in fp32, eager reference in float64 with the same weights); separate configs."""
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[family]
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(_config(family)), attn_implementation="cpscope")
    ref = cls._from_config(copy.deepcopy(_config(family)), attn_implementation="eager")
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        for layer in m.model.layers:
            assert layer.self_attn.scaling != SCALING  # really non-default: the attribute exists and changes
            layer.self_attn.scaling = SCALING
    assert model.config._attn_implementation == "cpscope" and ref.config._attn_implementation == "eager"
    return model.float(), ref.double()


def _batch(packed: bool):
    gen = torch.Generator().manual_seed(1)
    b = 1 if packed else 2
    ids = torch.randint(0, VOCAB, (b, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, 5] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return batch


def _reference(ref, batch, packed: bool):
    """Full-sequence float64 logits, loss and gradients, with the target shift done here independently."""
    ref.zero_grad()
    # use_cache=False: with a cache, transformers does not derive the packed-document mask from position_ids
    out = ref(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False)
    labels = batch["labels"]
    target = torch.full_like(labels, -100)
    target[:, :-1] = labels[:, 1:]
    if packed:
        ends = torch.cumsum(torch.tensor(DOCS), 0) - 1
        target[:, ends] = -100  # the last token of a document predicts nothing
    loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    return out.logits.detach(), loss.detach(), grads


def _enable_checkpointing(model, mode: str) -> None:
    """transformers' own activation checkpointing, as users turn it on; ``mode`` picks the call and its kwargs."""
    model.train()
    if mode == "hf_default":  # the call users make first: HF's default kwargs ({"use_reentrant": False} in 5.x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated alias of activation_checkpointing_enable
            model.gradient_checkpointing_enable()
        return
    kwargs = {
        "context_fn": {"use_reentrant": False, "context_fn": scope_context_fn()},  # the explicit, documented way
        "reentrant": {"use_reentrant": True},
        "non_reentrant": {"use_reentrant": False},
    }[mode]
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _count_attention_calls(model) -> list[int]:
    """A counter of attention module calls (forward and, with checkpointing, the recompute in backward)."""
    calls = [0]
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _decoder_matches_reference(sizes, packed, family="llama", checkpointing=None, compiled=False):
    """Microbatches of the CP sizes ``sizes`` through one model; each checked against the float64 reference.
    ``compiled``: through ``torch.compile(model)`` (AOTAutograd, eager kernels, a graph counter); returns the graphs
    after each microbatch and the graph-break reasons instead of ``True``."""
    assert cpscope.backward_read_check_enabled()  # on by default: backward must never read the active scope
    groups = cpscope.new_cp_groups(sorted(set(sizes)))
    model, ref = _models(family)
    if checkpointing:  # recompute in backward (outside the scope) must re-enter the forward's scope
        _enable_checkpointing(model, checkpointing)
    forward, graphs = (_compiled(model) if compiled else (model, None))
    calls = _count_attention_calls(model)
    layers = len(model.model.layers)
    batch = _batch(packed)
    ref_logits, ref_loss, ref_grads = _reference(ref, batch, packed)
    cu = [0] + torch.cumsum(torch.tensor(DOCS), 0).tolist() if packed else [0, SEQ]
    for size in sizes:  # mixed microbatches on the same model
        group = groups[size]
        model.zero_grad()
        with cpscope.runtime_cp(group):
            local = cphf.shard_batch(batch)
            out = forward(**local)
        rank = cpscope.scope.scope_for(group).rank
        idx = zigzag_index(cu, size, rank)
        torch.testing.assert_close(out.logits, ref_logits[:, idx].float(), atol=1e-4, rtol=1e-4)
        calls[0] = 0
        out.loss.backward()  # outside the scope: the ring kept its group on ctx, the recompute re-enters CP<size>
        assert calls[0] == (layers if checkpointing else 0), calls  # really recomputed (or not) in backward
        loss = out.loss.detach().clone()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if group is not None:
            dist.all_reduce(loss, group=group)
            for g in grads.values():
                dist.all_reduce(g, group=group)
        torch.testing.assert_close(loss, ref_loss.float(), atol=1e-5, rtol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name].float(), atol=1e-4, rtol=1e-4, msg=f"{name}, CP{size}")
        if graphs is not None:
            graphs.append(graphs[0])
    if graphs is None:
        return True
    from torch._dynamo.utils import counters

    breaks = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    torch._dynamo.reset()
    return {"graphs": graphs[1:], "breaks": breaks}


def _compiled(model):
    """``torch.compile(model)`` with a counter of the graphs handed to AOTAutograd (eager kernels): Dynamo's
    capture and guards are what inductor meets too; inductor itself would add minutes of C++ compilation here."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    aot_eager, graphs = lookup_backend("aot_eager"), [0]

    def backend(gm, example_inputs):
        graphs[0] += 1
        return aot_eager(gm, example_inputs)

    return torch.compile(model, backend=backend), graphs


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_llama_matches_reference_2_ranks(packed):
    assert run_ranks(2, _decoder_matches_reference, [2, 1], packed) == [True, True]


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_llama_matches_reference_4_ranks(packed):
    assert all(run_ranks(4, _decoder_matches_reference, [4, 2, 1], packed))


def test_llama_compiled_matches_reference_2_ranks():
    """``torch.compile(model)`` of a transformers decoder with ``attn_implementation="cpscope"``, packed documents,
    microbatches of CP2, CP1, CP2, CP1 on one compiled model: each equals the float64 reference; the attention
    function is one eager island (its scope read and checks never traced: no other graph break); nothing compiles
    after the first two microbatches (the CP size changes only lengths, which automatic dynamic then covers)."""
    for res in run_ranks(2, _decoder_matches_reference, [2, 1, 2, 1], True, "llama", None, True):
        assert res["breaks"] and all("torch.compiler.disable" in r for r in res["breaks"]), res
        assert res["graphs"][0] > 0 and res["graphs"][1:] == [res["graphs"][1]] * 3, res


def test_llama_with_activation_checkpointing_2_ranks():
    assert run_ranks(2, _decoder_matches_reference, [2, 1], True, "llama", "context_fn") == [True, True]


@pytest.mark.parametrize("mode", ["hf_default", "reentrant", "non_reentrant"])
def test_llama_with_transformers_own_checkpointing_2_ranks(mode):
    """``model.gradient_checkpointing_enable()`` as is, CP2 then CP1, backward outside the scope: the single-rank
    (float64 reference) logits and gradients. Before cpscope wrapped transformers' checkpoint function, the CP2
    recompute ran CP1 attention on one rank's shards and the ring's backward hung."""
    assert run_ranks(2, _decoder_matches_reference, [2, 1], False, "llama", mode) == [True, True]


def test_qwen2_packed_with_transformers_own_checkpointing_2_ranks():
    assert run_ranks(2, _decoder_matches_reference, [2], True, "qwen2", "reentrant") == [True, True]


def _unwrapped_checkpointing_raises_on_every_rank(use_reentrant: bool):
    """Without the wrapper (torch's checkpoint installed by hand), the recompute's scope read raises on every rank,
    at the same point (before any collective): an error, never a hang or a wrong gradient."""
    groups = cpscope.new_cp_groups([2])
    model, _ = _models()
    _enable_checkpointing(model, "non_reentrant")
    plain = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=use_reentrant)
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = plain
    with cpscope.runtime_cp(groups[2]):
        out = model(**cphf.shard_batch(_batch(False)))
    with pytest.raises(cpscope.ScopeReadInBackwardError, match="read inside autograd backward"):
        out.loss.backward()
    # ... and the documented one call fixes a model set up that way.
    assert cphf.enable_scoped_recompute(model) >= len(model.model.layers)
    assert all(isinstance(layer._gradient_checkpointing_func, cphf.ScopedCheckpointFunction)
               for layer in model.model.layers)
    with cpscope.runtime_cp(groups[2]):
        out = model(**cphf.shard_batch(_batch(False)))
    out.loss.backward()
    return True


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_unwrapped_checkpointing_raises_on_every_rank_2_ranks(use_reentrant):
    assert run_ranks(2, _unwrapped_checkpointing_raises_on_every_rank, use_reentrant, timeout=120) == [True, True]


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_decoders_match_reference_2_ranks(family):
    assert run_ranks(2, _decoder_matches_reference, [2], False, family) == [True, True]


def _unsharded_position_ids_are_refused():
    groups = cpscope.new_cp_groups([2])
    model, _ = _models()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with cpscope.runtime_cp(groups[2]):
        local = cphf.shard_batch({"input_ids": ids})
        with pytest.raises(ValueError, match="not one sequence per row in cpscope's zigzag layout"):
            model(input_ids=local["input_ids"], position_ids=torch.arange(SEQ // 2).unsqueeze(0))
        with pytest.raises(ValueError, match="document 1 has length 6"):  # 2*cp = 4
            cphf.shard_batch({"input_ids": ids, "position_ids": torch.cat([torch.arange(26), torch.arange(6)])[None]})


def test_unsharded_position_ids_are_refused_2_ranks():
    run_ranks(2, _unsharded_position_ids_are_refused)


# ------------------------------------------------------------------------------------------------ CP1, no dist


def test_padding_mask_is_refused():
    model, _ = _models()
    ids = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match=r"2-D attention_mask with 3 zeros \(padding\) of shape \(2, 8\)"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="3 zeros"):
        cphf.shard_batch({"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ValueError, match=r"4-D attention_mask of shape \(2, 1, 8, 8\)"):
        model(input_ids=ids, attention_mask=torch.zeros(2, 1, 8, 8))
    # An all-ones mask is harmless (tokenizers return one): same logits as without.
    torch.testing.assert_close(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits,
                               model(input_ids=ids).logits)
    assert "attention_mask" not in cphf.shard_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_packed_position_ids_without_offsets_are_refused():
    model, _ = _models()
    ids = torch.randint(0, VOCAB, (1, 16))
    with pytest.raises(ValueError, match="local token 8 has position 0, expected 8"):
        model(input_ids=ids, position_ids=torch.cat([torch.arange(8), torch.arange(8)])[None])


def test_unsupported_options_are_refused():
    model, _ = _models()
    q = torch.zeros(1, 4, 8, 16)
    kv = torch.zeros(1, 2, 8, 16)
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="dropout=0.1"):
        cphf.cpscope_attention_forward(attn, q, kv, kv, None, dropout=0.1)
    out, weights = cphf.cpscope_attention_forward(attn, q, kv, kv, None, sliding_window=8)  # covers it: fine
    assert out.shape == (1, 8, 4, 16) and weights is None
    with pytest.raises(ValueError, match="query length 1 != key length 8"):
        cphf.cpscope_attention_forward(attn, q[:, :, :1], kv, kv, None)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="different cu_seq_lens_q"):
        cphf.cpscope_attention_forward(attn, q, kv, kv, None, cu_seq_lens_q=cu,
                                       cu_seq_lens_k=torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch size 2"):
        cphf.cpscope_attention_forward(attn, q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1),
                                       kv.expand(2, -1, -1, -1), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_checkpoint_function_is_wrapped_and_follows_the_model():
    import pickle

    model, ref = _models()
    _enable_checkpointing(model, "reentrant")
    _enable_checkpointing(ref, "reentrant")  # an eager model: the wrapper passes its calls through unchanged
    fn = model.model.layers[0]._gradient_checkpointing_func
    assert isinstance(fn, cphf.ScopedCheckpointFunction) and fn._model() is model
    calls = []
    ref_fn = ref.model.layers[0]._gradient_checkpointing_func
    passthrough = cphf.ScopedCheckpointFunction(lambda f, *a: calls.append(f), ref)
    plain = ref_fn.inner
    passthrough(plain)
    assert calls == [plain]  # not scoped for a non-cpscope model
    twin = copy.deepcopy(model)
    assert twin.model.layers[0]._gradient_checkpointing_func._model() is twin
    assert pickle.loads(pickle.dumps(cphf.ScopedCheckpointFunction(len, model)))._model is None


def test_shard_batch_cp1_shifts_labels_and_counts_targets():
    ids = torch.arange(16).reshape(2, 8)
    out = cphf.shard_batch({"input_ids": ids, "labels": ids, "num_items_in_batch": 99, "use_cache": False})
    assert torch.equal(out["input_ids"], ids) and torch.equal(out["labels"], ids)
    assert torch.equal(out["position_ids"], torch.arange(8).expand(2, 8))
    expected = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    assert torch.equal(out["shift_labels"], expected)
    assert out["num_items_in_batch"] == 99 and out["use_cache"] is False  # given ones pass through
    assert int(cphf.shard_batch({"input_ids": ids, "labels": ids})["num_items_in_batch"]) == 14
    packed = cphf.shard_batch({"input_ids": ids[:1], "labels": ids[:1],
                               "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])})
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 8] and packed["cu_seq_lens_q"].dtype == torch.int32
    assert packed["max_length_q"] == 5
    assert packed["shift_labels"].tolist() == [[1, 2, -100, 4, 5, 6, 7, -100]]
    with pytest.raises(ValueError, match="need batch size 1"):
        cphf.shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])})
    with pytest.raises(ValueError, match="does not know how to shard 'pixel_mask'"):
        cphf.shard_batch({"input_ids": ids, "pixel_mask": torch.ones(2, 8)})
    with pytest.raises(ValueError, match="needs input_ids or inputs_embeds"):
        cphf.shard_batch({"labels": ids})


# ------------------------------------------------------------------------------------------------ host syncs


class _HostSyncCounter:
    """Counts host synchronisations during a block, attributed to the decoder layer running at the time.

    Dispatch-level: ops whose result the host must wait for on a GPU (``item`` / ``int`` / ``bool`` of a tensor
    → ``_local_scalar_dense`` / ``is_nonzero``; ``equal``; data-dependent shapes: ``nonzero``, ``masked_select``,
    ``unique``, ``repeat_interleave`` without ``output_size``). Python-level: ``Tensor.tolist``, ``.numpy``,
    ``.cpu`` (on CPU those dispatch nothing, so they are counted where they are called).

    Not counted: the inside of cpscope's CPU exact-math attention blocks (``cpscope.attention._kernels.exact``
    ``forward`` / ``backward``), the stand-in on CPU for the GPU's cuDNN / flash kernels (it builds its document mask with
    ``repeat_interleave``); everything around them — the adapter, validation, ring plan, RoPE — is counted.
    """

    _OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive")
    _METHODS = ("tolist", "numpy", "cpu")

    def __init__(self, model) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.where = "outside layers"
        self.counts: dict[str, list[str]] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                tensor_repeats = name == "repeat_interleave" and func._overloadname != "self_int"
                if name in _HostSyncCounter._OPS or (tensor_repeats and (kwargs or {}).get("output_size") is None):
                    counter.counts.setdefault(counter.where, []).append(f"aten.{name}")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "where", f"layer {i}")))
            self.handles.append(layer.register_forward_hook(lambda *_: setattr(self, "where", "outside layers")))
        self.saved = {m: getattr(torch.Tensor, m) for m in self._METHODS}
        from cpscope.attention._kernels import exact

        self.blocks = exact
        self.kernels = {name: getattr(exact, name) for name in ("forward", "backward")}

    def _in_kernel(self, fn):
        def run(*args, **kwargs):
            where, self.where = self.where, "CPU kernel (not counted)"
            try:
                return fn(*args, **kwargs)
            finally:
                self.where = where
        return run

    def __enter__(self):
        for name, fn in self.kernels.items():
            setattr(self.blocks, name, self._in_kernel(fn))
        for name, method in self.saved.items():
            def counted(t, *a, _name=name, _method=method, **k):
                self.counts.setdefault(self.where, []).append(f"Tensor.{_name}")
                return _method(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)
        for name, fn in self.kernels.items():
            setattr(self.blocks, name, fn)
        for h in self.handles:
            h.remove()


def _layers_add_no_host_sync(family: str, packed: bool):
    cfg = _config(family)
    cfg.num_hidden_layers = 4
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM}[family]
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="cpscope").float()
    groups = cpscope.new_cp_groups([2])
    batch = _batch(packed)
    with cpscope.runtime_cp(groups[2]):
        local = cphf.shard_batch(batch)
        if packed:  # as some collators give it: a 0-D tensor (read once, not once per layer)
            local["max_length_q"] = local["max_length_k"] = torch.tensor(local["max_length_q"])
        ones = torch.ones_like(local["input_ids"])
        # A 2-D all-ones mask from a tokenizer, as HF users pass it (checked, then dropped by the mask function).
        with _HostSyncCounter(model) as counter:
            out = model(**local, attention_mask=ones)
    assert out.logits.shape[1] == SEQ // 2
    counter.counts.pop("CPU kernel (not counted)", None)
    per_layer = {k: v for k, v in counter.counts.items() if k.startswith("layer ") and k != "layer 0"}
    assert per_layer == {}, per_layer  # layers >= 1 add no host synchronisation
    return counter.counts


@pytest.mark.parametrize("family,packed", [("llama", False), ("llama", True), ("mistral", True)],
                         ids=["llama-bshd", "llama-packed", "mistral-packed-window"])
def test_layers_add_no_host_sync_2_ranks(family, packed):
    counts = run_ranks(2, _layers_add_no_host_sync, family, packed)
    assert counts[0] == counts[1]  # the same host work on both ranks
    assert "layer 0" in counts[0]  # the counter sees the first layer's one-off checks (it can fail)
