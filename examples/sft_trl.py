"""Fine-tune a tiny decoder with TRL's ``SFTTrainer(packing=True)`` and hybrid CP on 4 CPU gloo ranks.

The script makes everything it needs: a character-level tokenizer, a dataset of documents with a long-tail length
distribution (each a repeated random pattern, so the loss falls once attention learns to copy), and a tiny Llama
(or Qwen3) from a config, seeded — no download. ``--mode hybrid`` trains it on 4 ranks with
:class:`cpscope.integrations.hf.trainer.HybridCPSFTTrainer`: every step, TRL's packed rows of all ranks are planned
into CP1 / CP2 / CP4 microbatches; ``--mode single`` trains the same model on the same data in one process with the
plain ``SFTTrainer`` and 4× the batch per device: the logged losses are the same.

The change against a plain TRL script is three lines::

    import cpscope.integrations.hf.trainer as cpt
    trainer = cpt.HybridCPSFTTrainer(model=model, args=sft_config, train_dataset=ds, processing_class=tok,
                                     hybrid_cp=cpt.HybridCP(capacity=48))

Run it::

    python examples/sft_trl.py                                  # spawns 4 gloo ranks itself
    torchrun --nproc_per_node=4 examples/sft_trl.py
    accelerate launch --cpu --num_processes 4 examples/sft_trl.py
    python examples/sft_trl.py --mode single                    # the reference: one process, no CP
    python examples/sft_trl.py --trainer trainer                # plain Trainer + DataCollatorWithFlattening
    python examples/sft_trl.py --gradient-checkpointing --grad-accum 2 --model qwen3

Options: ``--steps``, ``--batch`` (rows per rank), ``--grad-accum``, ``--capacity``, ``--max-length``,
``--gradient-checkpointing``, ``--model llama|qwen3``, ``--fsdp``, ``--lora``, ``--bf16``, ``--seed`` (``--help``).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `_launch` (next to this file) and `cpscope` importable
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpscope.hybrid import CostModel, long_tail_lengths  # noqa: E402

WORLD = 4
# The planner's cost model for this tiny CPU model: per-token work dominates, every ring step costs a little.
CPU_COST = CostModel(attn=2e-8, linear=1e-5, comm=2e-6, latency=2e-4)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
SPECIAL = ("<pad>", "<eos>", "<unk>")


@dataclass
class SFTRun:
    mode: str = "hybrid"  # "hybrid": 4 ranks with cpscope; "single": one process, the plain trainer
    trainer: str = "sft"  # "sft": TRL SFTTrainer(packing=True); "trainer": Trainer + DataCollatorWithFlattening
    model: str = "llama"  # "llama" or "qwen3"
    steps: int = 4
    batch: int = 2  # rows per rank per micro-step (packed rows for SFT, documents for the plain Trainer)
    grad_accum: int = 1
    max_length: int = 128  # TRL's packed row length
    capacity: int = 48  # tokens per rank per microbatch: longer documents run at CP2 / CP4
    gradient_checkpointing: bool = False
    fsdp: bool = False
    lora: bool = False  # train LoRA adapters (PEFT) on the attention projections instead of all weights
    bf16: bool = False  # bf16 autocast (TRL's default); fp32 by default here, to compare runs exactly
    lr: float = 0.5
    seed: int = 0
    n_docs: int = 0  # 0: enough for the steps
    median_len: int = 24
    hidden: int = 64
    layers: int = 2


@dataclass
class SFTResult:
    losses: list[float]  # the trainer's logged loss of every step
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    cp_history: list[dict] = field(default_factory=list)
    seconds: float = 0.0  # wall time of trainer.train()
    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)  # wall time of every optimizer step (this rank)
    sync: str = ""  # the hybrid step's gradient synchronisation (DDPSync, FSDPSync, ManualSync)
    gradient_checkpointing: bool = False  # the model's checkpointing really on


# ------------------------------------------------------------------------------------------------------------
# Tokenizer, data, model: all made here, seeded


def make_tokenizer() -> Any:
    """A character-level fast tokenizer over ``a-z``, space and three special tokens (no download)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL, " ", *ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_texts(run: SFTRun) -> list[str]:
    """Documents of long-tail lengths, each a random pattern of 2-6 letters repeated (seeded)."""
    n = run.n_docs or max(64, run.steps * run.grad_accum * WORLD * run.batch * 6)
    lengths = long_tail_lengths(n, seed=run.seed, median=run.median_len, sigma=0.9, min_len=4,
                                max_len=run.max_length - 1, granularity=1).tolist()
    gen = torch.Generator().manual_seed(run.seed + 1)
    texts = []
    for length in lengths:
        period = int(torch.randint(2, 7, (1,), generator=gen))
        pattern = "".join(ALPHABET[int(i)] for i in torch.randint(0, 26, (period,), generator=gen))
        texts.append((pattern * (length // period + 1))[:length])
    return texts


def make_model(run: SFTRun, vocab_size: int) -> Any:
    """A tiny Llama or Qwen3 (GQA, RoPE) from a config, seeded: the same weights on every rank."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=run.hidden, intermediate_size=2 * run.hidden,
                  num_hidden_layers=run.layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4 * run.max_length, attention_dropout=0.0, pad_token_id=0, eos_token_id=1,
                  bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(run.seed)
    if run.model == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    if run.model != "llama":
        raise ValueError(f"model must be 'llama' or 'qwen3', got {run.model!r}")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def fsdp2_model(model: Any, out: str) -> Any:
    """``model`` sharded with FSDP2 over the world by transformers itself (``from_pretrained(distributed_config=
    DistributedConfig(fsdp_size=world))``: every decoder layer and the root); the trainer then wraps it in nothing.
    accelerate's own FSDP plugin is for accelerators only: with ``use_cpu=True`` it falls back to DDP."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    paths = [os.path.join(out, "init")]
    if dist.is_initialized():  # rank 0 saves (transformers saves on the main process only), every rank loads
        dist.broadcast_object_list(paths, src=0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(paths[0])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():
        dist.barrier()
    sharded = AutoModelForCausalLM.from_pretrained(paths[0], distributed_config=DistributedConfig(fsdp_size=world))
    if dist.is_initialized():
        dist.barrier()  # rank 0's folder lives until the trainer is done; every rank has read it by now
    return sharded


def _common_args(run: SFTRun, out: str, world: int) -> dict[str, Any]:
    per_device = run.batch if run.mode == "hybrid" else run.batch * WORLD
    args = dict(output_dir=out, max_steps=run.steps, per_device_train_batch_size=per_device,
                gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, optim="sgd",
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                report_to=[], save_strategy="no", use_cpu=True, seed=run.seed, data_seed=run.seed,
                disable_tqdm=True, dataloader_num_workers=0, bf16=run.bf16)
    from transformers import TrainingArguments

    # transformers >= 5.2x names it activation_checkpointing (gradient_checkpointing is its deprecated alias)
    ckpt = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    args[ckpt] = run.gradient_checkpointing
    return args


def build_trainer(run: SFTRun, out: str) -> Any:
    """The trainer of ``run``: hybrid CP (4 ranks) or the plain one (one process); SFTTrainer or Trainer."""
    import datasets

    world = dist.get_world_size() if dist.is_initialized() else 1
    tok = make_tokenizer()
    model = make_model(run, len(tok))
    if run.fsdp:
        model = fsdp2_model(model, out)
    texts = make_texts(run)
    hybrid = run.mode == "hybrid"
    kwargs: dict[str, Any] = {}
    if hybrid:
        import cpscope.integrations.hf.trainer as cpt

        kwargs["hybrid_cp"] = cpt.HybridCP(capacity=run.capacity, cost=CPU_COST)
    if run.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(packing=True, max_length=run.max_length, dataset_text_field="text",
                           **_common_args(run, out, world))
        if run.lora:
            from peft import LoraConfig

            kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        cls = cpt.HybridCPSFTTrainer if hybrid else SFTTrainer
        return cls(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                   processing_class=tok, **kwargs)
    if run.trainer != "trainer":
        raise ValueError(f"trainer must be 'sft' or 'trainer', got {run.trainer!r}")
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    ids = [tok(t + tok.eos_token)["input_ids"] for t in texts]
    cls = cpt.HybridCPTrainer if hybrid else Trainer
    return cls(model=model, args=TrainingArguments(**_common_args(run, out, world)),
               train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
               data_collator=DataCollatorWithFlattening(), **kwargs)


def _step_timer(times: list[float]) -> Any:
    """A callback appending each optimizer step's wall time (begin to end, optimizer included) to ``times``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.t0)

    return StepTimer()


@contextlib.contextmanager
def accelerate_env() -> Iterator[None]:
    """The environment accelerate reads to see an already initialised world (restored afterwards)."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    if dist.is_initialized():
        world, rank = str(dist.get_world_size()), str(dist.get_rank())
        os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights as full CPU tensors (FSDP2's shards gathered: collective)."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().to("cpu", copy=True)
    return out


def train(run: SFTRun) -> SFTResult:
    """Build the trainer of ``run`` and train; collective over the world in ``hybrid`` mode."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if (run.mode == "single") != (world == 1) or (run.mode == "hybrid" and world != WORLD):
        raise ValueError(f"mode={run.mode!r} needs {'one process' if run.mode == 'single' else '4 ranks'}, "
                         f"got a world of {world}")
    with accelerate_env(), tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(run, out)
        step_seconds: list[float] = []
        trainer.add_callback(_step_timer(step_seconds))
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        sync = getattr(trainer, "cp_sync", None)
        return SFTResult(losses=losses, state=full_state(trainer.model),
                         cp_history=list(getattr(trainer, "cp_history", [])), seconds=seconds,
                         steps=trainer.state.global_step, step_seconds=step_seconds,
                         sync=type(sync).__name__ if sync is not None else "",
                         gradient_checkpointing=any(getattr(m, "gradient_checkpointing", False) is True
                                                    for m in trainer.model.modules()))


# ------------------------------------------------------------------------------------------------------------
# Reporting and launching


def summarize(run: SFTRun, res: SFTResult, world: int) -> str:
    lines = [f"mode={run.mode} trainer={run.trainer} model={run.model} ranks={world} steps={res.steps} "
             f"batch={run.batch}/rank grad_accum={run.grad_accum} capacity={run.capacity} "
             f"gradient_checkpointing={run.gradient_checkpointing} sync={res.sync or '-'}",
             "step  loss      microbatches by CP size (counted once per group)   tokens/s"]
    for i, loss in enumerate(res.losses):
        mix, tps = "-", ""
        if i < len(res.cp_history):
            h = res.cp_history[i]
            mix = ", ".join(f"CP{cp}: {n}" for cp, n in sorted(h["microbatches"].items(), reverse=True))
            tps = f"{h['tokens'] / h['seconds']:,.0f}"
        lines.append(f"{i:>4}  {loss:.6f}  {mix:<44} {tps}")
    later = sorted(res.step_seconds[1:]) or res.step_seconds
    median = later[len(later) // 2] if later else float("nan")
    lines.append(f"time: {res.seconds:.2f} s for {res.steps} steps; per step after the first: median {median:.3f} s "
                 f"(rank 0, optimizer included)")
    return "\n".join(lines)


def _rank_main(run: SFTRun, save: Optional[str]) -> None:
    res = train(run)
    if dist.get_rank() == 0:
        print(summarize(run, res, dist.get_world_size()), flush=True)
        if save:
            torch.save(res.state, save)


def parse_args(argv: Optional[list[str]] = None) -> tuple[SFTRun, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("hybrid", "single"), default="hybrid")
    p.add_argument("--trainer", choices=("sft", "trainer"), default="sft")
    p.add_argument("--model", choices=("llama", "qwen3"), default="llama")
    for name in ("steps", "batch", "grad_accum", "max_length", "capacity", "seed", "hidden", "layers", "median_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(SFTRun, name))
    p.add_argument("--lr", type=float, default=SFTRun.lr)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (mixed precision)")
    p.add_argument("--lora", action="store_true", help="LoRA adapters (PEFT) on the attention projections")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (transformers' distributed_config, fsdp_size=world)")
    p.add_argument("--save-weights", metavar="PATH", default=None)
    a = p.parse_args(argv)
    run = SFTRun(mode=a.mode, trainer=a.trainer, model=a.model, steps=a.steps, batch=a.batch,
                 grad_accum=a.grad_accum, max_length=a.max_length, capacity=a.capacity, seed=a.seed, lr=a.lr,
                 hidden=a.hidden, layers=a.layers, median_len=a.median_len,
                 gradient_checkpointing=a.gradient_checkpointing, fsdp=a.fsdp,
                 bf16=a.bf16, lora=a.lora)
    return run, a


def main(argv: Optional[list[str]] = None) -> None:
    run, a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if run.mode == "single":
        res = train(run)
        print(summarize(run, res, 1))
        if a.save_weights:
            torch.save(res.state, a.save_weights)
        return
    from _launch import launch

    launch(_rank_main, WORLD, run, a.save_weights, backend="gloo")


if __name__ == "__main__":
    main()
