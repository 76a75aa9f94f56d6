"""One rank of tests/distributed/test_fsdp.py: pp=2 x dp=2 with each stage sharded (FSDP2).

``python fsdp_worker.py CONFIGS OUT`` under torchrun's environment. CONFIGS is
``model:schedule:checkpoint[:flags]`` items joined by ``,``; each trains WINDOWS
windows of sharded_worker.STEPS steps (AdamW, clipping, a scheduler) on a sharded
mesh (flags: ``whole``, the replicated one; ``disk``, ``grad_backup="disk"``;
``action``, ``init_mesh(reshard="action")``).
Models: ``mlp``; ``mlp32`` (fp32); ``drop`` (a dropout from step LATE on: that step
is put back and rerun); ``traced`` (a tied LM); ``gpt2`` (HF's, traced); ``ckpt``
(saved after SAVE_AT steps, resumed by a new sharded pipeline; a mid-window save
refused); ``meta`` (built on meta, loads that checkpoint); ``early`` (its optimizer
built before the Pipeline); ``failstep`` (a window end failing on one rank inside
optimizer.step, then flushed); ``inf`` (an inf in one replica's batch: its window
skipped on every rank); ``branch`` (a weight only replica 0's data reaches); ``frozen``
(pp rank 0's stage frozen); ``hsdp`` (pp=1 x dp=4, shard groups of 2); ``resume``
(on 2 ranks: the checkpoint at pp=2 x dp=1, unsharded). Each rank writes per config the
parameters its stages use (whole), its bytes held and its reductions.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipesched import GradientAccumulator, Pipeline
from pipesched.errors import CheckpointError, RemoteError
from pipesched.runtime.mesh import init_mesh
from tests.distributed import sharded_worker as w

WINDOWS = 3
PP = 2
BALANCE = {1: [8], 2: [4, 4], 4: [2, 2, 2, 2]}
LATE = 3  # the second window's last step: its rerun must still reduce-scatter after it
FAIL_AT = 3  # "failstep": the second window's end fails on rank 1, is put back, flushed
SAVE_AT = 4  # "ckpt": saved after two windows; its last resumed, here and elsewhere
INF_AT = 2  # "inf": replica 0's batch of this step (the second window's first) holds an inf


def gpt2() -> nn.Module:
    """A small HF GPT-2 (its head tied to its token embedding), no dropout."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_batch(step: int, replica: int = 0, replicas: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 32, (w.ROWS, 8), generator=torch.Generator().manual_seed(300 + step))
    share = w.ROWS // replicas
    return ids[replica * share : (replica + 1) * share]


def gpt2_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over the micro-batch's tokens."""
    logits, labels = out.logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Marked(nn.Module):
    """Scales the rows whose first feature is above 2 by a weight of its own: only micro-batches
    holding such a row use it ("branch": replica 0's only, so replica 1 has no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((6,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = x[:, 0] > 2
        if not bool(marked.any()):
            return x
        return torch.where(marked[:, None], x * self.weight, x)


def branch_mlp() -> nn.Sequential:
    return nn.Sequential(Marked(), *w.mlp(0.0))


def branch_batch(
    step: int, replica: int = 0, replicas: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sharded_worker.batch`` with one marked row, row 0: in replica 0's share."""
    x, y = w.batch(step)
    x = x.clone()
    x[:, 0] = -1.0
    x[0, 0] = 3.0
    share = w.ROWS // replicas
    return x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]


def frozen_mlp() -> nn.Sequential:
    """The MLP with its first stage (at pp=2) frozen: pp rank 0 trains nothing."""
    model = w.mlp(0.0)
    for layer in model[:4]:
        layer.requires_grad_(False)
    return model


def pipeline(
    name: str, schedule: str, checkpoint: str, mesh: Any, backup: str = "device"
) -> Pipeline:
    stages = 4 if schedule in ("interleaved-1f1b", "zb-v") else 1 if name == "hsdp" else 2
    if name == "gpt2":
        return Pipeline(
            gpt2(), 2, mesh=mesh, num_stages=stages, schedule=schedule, checkpoint=checkpoint,
            example_inputs=(gpt2_batch(0)[:2],),
        )  # fmt: skip
    if name == "traced":
        return Pipeline(
            w.tied_lm(), 2, split_points=["fc2"], mesh=mesh, num_stages=2,
            example_inputs=(w.tokens(0)[0][:2],), schedule=schedule, checkpoint=checkpoint,
        )  # fmt: skip
    if name == "meta":  # each rank allocates only its stages, then shards them
        with torch.device("meta"):
            model = w.mlp(0.0)
        return Pipeline(
            model, 2, balance=BALANCE[stages], mesh=mesh, schedule=schedule,
            checkpoint=checkpoint, init_weights="skip",
        )  # fmt: skip
    if name == "branch":
        return Pipeline(
            branch_mlp(), 2, balance=[5, 4], mesh=mesh, schedule=schedule, checkpoint=checkpoint
        )
    model = frozen_mlp() if name == "frozen" else w.mlp(0.0)  # (in the default dtype)
    if name == "drop":
        model[6] = LateDropout()  # for a Tanh: in the last stage
    return Pipeline(
        model, 2, balance=BALANCE[stages], mesh=mesh, schedule=schedule,
        checkpoint=checkpoint,
    )  # fmt: skip


class LateDropout(nn.Module):
    """Tanh, then ``F.dropout`` from step LATE on: a draw where none was seen before."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x.tanh(), 0.2, self.training and self.on)


def fail_window_end(acc: GradientAccumulator, i: int, replica: int, dp: int) -> dict[str, Any]:
    """Step ``i`` (a window's last) with rank 1's optimizer failing once after it stepped.

    Every rank's window end is put back (the shards' gradients too); ``flush()`` retries it.
    """
    optimizer = acc.optimizers[0]
    step = optimizer.step
    before = {n: p.detach().clone() for n, p in acc.pipe.named_parameters() if not p.is_meta}
    if dist.get_rank() == 1:

        def fail(*args: Any, **kwargs: Any) -> None:
            optimizer.step = step  # type: ignore[method-assign]
            step(*args, **kwargs)  # this rank's shards move...
            raise RuntimeError("rank 1's optimizer failed")  # ...then it fails

        optimizer.step = fail  # type: ignore[method-assign]
    seen, named = None, None
    try:
        w.train(acc, range(i, i + 1), replica, dp)
    except (RuntimeError, RemoteError) as err:
        seen, named = type(err).__name__, getattr(err, "rank", None)
    after = {n: p.detach() for n, p in acc.pipe.named_parameters() if not p.is_meta}
    put_back = all(torch.equal(_whole(before[n]), _whole(p)) for n, p in after.items())
    result = {"error": seen, "rank": named, "pending": acc.window_end_pending}
    result["put_back"] = put_back
    acc.flush()
    return result


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def held_bytes(acc: GradientAccumulator) -> int:
    """This rank's parameter + gradient + optimizer-state bytes (of the parameters it uses)."""
    params = acc.pipe._cuts.current[1].sync.parameters
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        v
        for opt in acc.optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return local_bytes(params) + local_bytes(grads) + local_bytes(state)


def whole_bytes_at_forwards(pipe: Pipeline) -> list[int]:
    """At each forward of a sharded group, the bytes of this rank's parameters held whole."""
    groups = pipe._cuts.current[1].sync.sharded
    seen: list[int] = []

    def hook(*_: Any) -> None:
        seen.append(
            sum(
                p.numel() * p.element_size()
                for g in groups
                for p in g.parameters()
                if not isinstance(p, DTensor)
            )
        )

    model = {id(m) for m in pipe.modules()}
    for group in groups:
        # A stage (an nn.Sequential's) runs its groups' hooks; a traced model's owner is
        # called by no stage (the trace runs its code), and a hook put on it after the
        # trace is a change of the model the Pipeline refuses.
        if id(group) not in model:
            group.register_forward_pre_hook(hook)
    return seen


def run(config: str, rank: int, out: Path) -> dict[str, Any]:
    # fp32 ("mlp32"): the reduce-scatter as users run it (gloo has no PreMulSum)
    torch.set_default_dtype(torch.float32 if config.startswith("mlp32") else torch.float64)
    name, schedule, checkpoint, *flags = config.split(":")
    whole = "whole" in flags
    backup = "disk" if "disk" in flags else "device"  # a later step adds in place
    if name == "hsdp":  # pp=1 x dp=4, sharded within pairs of replicas
        dp, pp, shard = dist.get_world_size(), 1, 2
    else:
        dp, pp = dist.get_world_size() // PP, PP
        shard = 1 if whole or dp == 1 else dp
    reshard = "action" if "action" in flags else "step"
    mesh = init_mesh(pp=pp, dp=dp, shard=shard, reshard=reshard, timeout=60)
    if name == "early":  # the optimizer built on the model, before the Pipeline shards it
        model = w.mlp(0.0)
        early = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(early, step_size=1, gamma=0.8)
        pipe = Pipeline(model, 2, balance=BALANCE[2], mesh=mesh, schedule=schedule)
        acc = GradientAccumulator(
            pipe, early, accumulation_steps=w.STEPS, max_grad_norm=0.5, lr_scheduler=scheduler
        )
    else:
        pipe = pipeline(name, schedule, checkpoint, mesh, backup)
        acc = w.accumulator(pipe)
    optimizer = acc.optimizers[0]
    optimizer_step, held = optimizer.step, []

    def measured(*args: Any, **kwargs: Any) -> Any:
        held.append(held_bytes(acc))  # the window's gradients are there, and the state
        return optimizer_step(*args, **kwargs)

    optimizer.step = measured  # type: ignore[method-assign]
    mid_window, failures = None, None
    whole = whole_bytes_at_forwards(pipe)
    if name in ("resume", "meta"):  # "ckpt"'s checkpoint: at pp=2 x dp=1; built on meta
        acc.load(str(out / "ckpt"))
    for i in range(acc.steps, WINDOWS * w.STEPS):
        if name == "ckpt" and i == SAVE_AT:  # saved sharded, resumed by a new sharded pipeline
            acc.save(str(out / "ckpt"))
            pipe = pipeline(name, schedule, checkpoint, mesh)
            acc = w.accumulator(pipe)
            acc.load(str(out / "ckpt"))
        if name == "ckpt" and i == SAVE_AT + 1:
            try:
                acc.save(str(out / "mid-window"))
            except CheckpointError as err:
                mid_window = str(err)
        if name == "drop" and i == LATE:
            for m in pipe.modules():
                if isinstance(m, LateDropout):
                    m.on = True
        if name == "gpt2":
            ids = gpt2_batch(i, mesh.get_local_rank("dp"), dp)
            acc.step(ids, ids, loss_fn=gpt2_loss)
        elif name == "failstep" and i == FAIL_AT:  # rank 1's optimizer raises after stepping
            failures = fail_window_end(acc, i, mesh.get_local_rank("dp"), dp)
        elif name == "branch":
            x, y = branch_batch(i, mesh.get_local_rank("dp"), dp)
            acc.step(x, y, loss_fn=nn.functional.mse_loss)
        elif name == "inf" and i == INF_AT:  # one replica's gradients: the window is skipped
            x, y = w.batch(i, mesh.get_local_rank("dp"), dp)
            if mesh.get_local_rank("dp") == 0:
                x = x.clone()
                x[0, 0] = float("inf")
            acc.step(x, y, loss_fn=nn.functional.mse_loss)
        else:
            w.train(acc, range(i, i + 1), mesh.get_local_rank("dp"), dp)
    evaluated = None
    if name == "mlp":  # a forward-only call after training: gathers and shards too
        pipe.eval()
        with torch.no_grad():
            evaluated = pipe(w.batch(99)[0])
        pipe.train()
    refused = None
    try:
        acc.state_dict()  # a per-rank state dict: refused where stages are sharded
    except CheckpointError as err:
        refused = str(err)
    sync = pipe._cuts.current[1].sync  # the engine's GradientSync
    mine = {id(p) for p in sync.parameters}  # (a traced model's pipeline holds others' too)
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in pipe.named_parameters()
        if id(p) in mine
    }
    result = {
        "params": params,
        "bytes": held[-1],
        "reduce_scatters": sync.reduce_scatters,
        "all_reduces": sync.all_reduces,
        "sharded": [type(s).__name__ for s in sync.sharded],
        "optimizer_state": len(optimizer.state),
        "reruns": pipe._cuts.current[1].reruns,
        "refused": refused,
        "evaluated": evaluated,
        "mid_window": mid_window,
        "failures": failures,
        "whole_peak": max(whole, default=0),
        "group_bytes": [
            sum(p.numel() * p.element_size() for p in g.parameters()) for g in sync.sharded
        ],
    }
    gc.collect()
    return result


def main(configs: str, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    init_mesh(pp=PP, dp=int(os.environ["WORLD_SIZE"]) // PP, timeout=60)  # the process group
    rank = dist.get_rank()
    results = {config: run(config, rank, out) for config in configs.split(",")}
    torch.save(results, out / f"{'resume-' if configs.startswith('resume') else ''}rank{rank}.pt")
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
