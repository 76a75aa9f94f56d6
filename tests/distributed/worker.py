"""One rank of a distributed test: `python worker.py SCENARIO OUT_DIR` under torchrun-like env."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline, Schedule, get_schedule
from pipesched.errors import ConfigError
from pipesched.runtime import fused_linear
from pipesched.runtime.mesh import init_mesh

# name: (pp, dp, schedule, balance)
SCENARIOS = {
    "pp2": (2, 1, "1f1b", [3, 4]),
    "pp2dp2": (2, 2, "zb-h1", [3, 4]),
    "interleaved": (2, 1, "interleaved-1f1b", [2, 2, 2, 1]),
    "zbv": (2, 1, "zb-v", [2, 2, 2, 1]),
    "tokens": (2, 2, "interleaved-1f1b", [1, 1, 2, 1]),
    "traced": (2, 2, "1f1b", None),  # torch.export-traced, cut by measured time
    "lazy": (2, 1, "1f1b", None),  # traced on its first step: no example_inputs
    # A user's Schedule read from CSV (here 1F1B's own table): it must run as 1F1B does.
    "csv": (2, 1, Schedule.from_csv(get_schedule("1f1b", 2, 4).to_csv()), [3, 4]),
    "raise": (2, 1, "1f1b", [3, 4]),
    "kill": (3, 1, "1f1b", [2, 2, 3]),
    "window-kill": (2, 1, "1f1b", [3, 4]),  # pp rank 1 killed in its window end's optimizer
    "raise-replica": (2, 2, "1f1b", [3, 4]),  # a stage of replica 1 raises, replica 0 does not
    "wider-replica": (2, 2, "1f1b", [3, 4]),  # replica 1 builds a wider layer: refused
    "hung-replica": (2, 2, "1f1b", [4, 4]),  # replica 1 hangs in a stage: replica 0 is told
}
WINDOWS, STEPS, CHUNKS = 2, 2, 4
TOKEN_SCENARIOS = ("tokens", "traced", "lazy")
ROWS = (10, 7)  # rows per step of replica 0 and replica 1: uneven on purpose
VOCAB = 11


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ).double()


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, VOCAB)
    ).double()


class TiedLM(nn.Module):
    """Not a Sequential: a skip connection, and the head tied to the embedding across stages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(self.fc2(torch.tanh(self.fc1(h))) + h)


def tied_lm() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM().double()


def model_of(scenario: str) -> nn.Module:
    return {"tokens": token_model, "traced": tied_lm, "lazy": tied_lm}.get(scenario, mlp)()


def data(window: int, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * window + 10 * step + replica)
    rows = ROWS[replica]
    return (
        torch.randn(rows, 6, generator=g, dtype=torch.float64),
        torch.randn(rows, 3, generator=g, dtype=torch.float64),
    )


def tokens(window: int, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(1000 * window + 10 * step + replica)
    length = 4 + (window + step + replica) % 3  # sequence lengths change between steps
    x = torch.randint(0, VOCAB, (6, length), generator=g)
    y = torch.randint(0, VOCAB, (6, length), generator=g)
    keep = 1 + (replica * 3 + step) % 4  # uneven token counts across steps and replicas
    y[:, keep:] = -100
    return x, y, int((y != -100).sum())


def token_pieces(window: int, step: int, replica: int) -> tuple[list[torch.Tensor], list, int]:
    """A step's batch as micro-batches of their own shapes: 2 rows each, sequences cut shorter."""
    x, y, _ = tokens(window, step, replica)
    length = x.shape[1]
    cuts = [(0, 2, length), (2, 4, length - 1), (4, 6, length - 2)]
    xs = [x[a:b, :n] for a, b, n in cuts]
    ys = [y[a:b, :n] for a, b, n in cuts]
    return xs, ys, sum(int((t != -100).sum()) for t in ys)


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2:  # micro-batch 2 of a 10-row batch in 4 chunks (3, 3, 2, 2)
            raise ValueError("boom in a stage")
        return x


class Die(nn.Module):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Die.calls += 1
        if Die.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class DieInStep(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        os.kill(os.getpid(), signal.SIGKILL)


class Stall(nn.Module):
    """Hangs (20 s) in its third forward on global rank 3 (replica 1's last stage)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Stall.calls += 1
        if Stall.calls == 3 and torch.distributed.get_rank() == 3:
            time.sleep(20)
        return x


def hung_replica() -> None:
    """Replica 0 waits for a hung replica 1 in the window's all-reduce: at most ``timeout``."""
    mesh = init_mesh(pp=2, dp=2, timeout=5)
    pipe = Pipeline(nn.Sequential(*mlp(), Stall()), CHUNKS, balance=[4, 4], mesh=mesh)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2
    )
    start = time.monotonic()
    try:
        for step in range(STEPS * 2):
            acc.step(*data(0, step, pipe.mesh.dp_rank), loss_fn=nn.functional.mse_loss)
    finally:
        print(f"stopped after {time.monotonic() - start:.1f} s", flush=True)


def main() -> None:
    # Every weight fused, however small: the distributed runtime's fused path stays covered.
    fused_linear.MIN_FUSED_BYTES = 0
    scenario, out = sys.argv[1], sys.argv[2]
    if scenario == "hung-replica":
        hung_replica()
        return
    pp, dp, schedule, balance = SCENARIOS[scenario]
    mesh = init_mesh(pp=pp, dp=dp, timeout=30)
    model = model_of(scenario)
    if scenario in ("pp2dp2", "traced") and torch.distributed.get_rank() // pp == 1:
        with torch.no_grad():  # replica 1 built with other weights: it must take replica 0's
            for p in model.parameters():
                p.add_(0.5)
    if scenario == "raise":
        model = nn.Sequential(*model[:3], Boom(), *model[3:])
        balance = [3, 5]
    if scenario == "raise-replica":  # ranks 2 and 3 are replica 1's
        replica = torch.distributed.get_rank() // pp
        model = nn.Sequential(*model[:3], Boom() if replica else nn.Identity(), *model[3:])
        balance = [3, 5]
    if scenario == "wider-replica" and torch.distributed.get_rank() // pp == 1:
        wider = [nn.Linear(6, 9).double(), nn.Tanh(), nn.Linear(9, 8).double()]
        model = nn.Sequential(*wider, *model[3:])
    if scenario == "kill":
        model = nn.Sequential(*model[:2], Die(), *model[2:])
        balance = [2, 3, 3]
    traced: dict[str, object] = {"num_stages": pp}
    if scenario == "traced":  # "lazy" is traced from its first step's first micro-batch
        traced["example_inputs"] = (tokens(0, 0, 0)[0][:2],)
    # A fixed cut (a measured one moved with the machine's load, and the buckets with it);
    # pp rank 1 asks for a cut of its own: rank 0's must win.
    traced["split_points"] = ["head"] if torch.distributed.get_rank() % pp == 1 else ["fc2"]
    pipe = Pipeline(
        model,
        CHUNKS,
        balance=balance,
        mesh=mesh,
        schedule=schedule,
        checkpoint="except_last",
        **(traced if scenario in ("traced", "lazy") else {}),
    )
    dies = scenario == "window-kill" and torch.distributed.get_rank() == 1
    acc = GradientAccumulator(
        pipe,
        (DieInStep if dies else torch.optim.SGD)(pipe.parameters(), lr=0.1),
        accumulation_steps=STEPS,
        max_grad_norm=0.5,
    )
    replica = pipe.mesh.dp_rank
    losses, norms = [], []
    for window in range(WINDOWS):
        for step in range(STEPS):
            if scenario == "lazy":  # a traced model, micro-batches of their own lengths
                xs, ys, n = token_pieces(window, step, replica)
                result = acc.step(microbatches=xs, targets=ys, loss_fn=token_sum, num_items=n)
            elif scenario in TOKEN_SCENARIOS:
                x, y, n = tokens(window, step, replica)
                result = acc.step(x, y, loss_fn=token_sum, num_items=n)
            else:
                x, y = data(window, step, replica)
                result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
        losses.append(result.window_loss)
        norms.append(result.grad_norm)
    whole = pipe.gather_timeline()  # a collective: every rank calls it
    predicted = pipe.predict()  # a collective too: the whole pipeline's step, on every rank
    own_events = len(pipe.last_timeline.events)
    x = (tokens if scenario in TOKEN_SCENARIOS else data)(WINDOWS, 0, 0)[0]
    try:  # a backward could not follow pipe(x) across ranks: refused before any transfer
        pipe(x)
        refused = False
    except ConfigError:
        refused = True
    with torch.no_grad():
        evaluated = pipe(x)  # the output on the last stage's rank, None on the others
    torch.save(
        {
            "gathered": None
            if whole is None
            else [(tuple(e.action), e.worker, e.start, e.end) for e in whole.events],
            "own_events": own_events,
            "predicted": predicted.to_json(),
            "evaluated": evaluated,
            "refused": refused,
            "balance": pipe.balance,
            "params": {  # this rank's (a traced model registers the others' too, on meta)
                n: p.detach().clone() for n, p in pipe.named_parameters() if p.device.type != "meta"
            },
            "all_reduces": pipe.sync.all_reduces,
            "overlapped": getattr(pipe.sync, "overlapped", 0),
            "receives": (  # (not pre-posted, posted but never read)
                pipe.engine.runtime.stats.unplanned,
                pipe.engine.runtime.stats.unread,
            ),
            "window_losses": losses,
            "norms": norms,
            "effective_batch": result.effective_batch,
            "foreign_devices": sorted(
                {str(p.device) for p in model.parameters()} - {str(pipe.mesh.device)}
            ),
        },
        os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"),
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
