"""One rank of a script that ends right after a step: `python exit_worker.py SCENARIO OUT_DIR`.

(Both arguments are ignored.) A pipeline of one stage per rank runs one
step, and the script ends at once. The rank runs on one core, its main
thread holds the GIL from the step's return to the interpreter's exit (a
long switch interval, nothing that blocks), and every other thread (gloo's)
runs at the lowest priority: a gloo worker thread that still had to free a
tensor of the step's last collective would do so only during the exit, where
taking the GIL aborts the process ("terminate called without an active
exception"), as pipesched did before it kept those works (mesh.wait_kept).
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from torch import nn

from pipesched import Pipeline
from pipesched.runtime.mesh import init_mesh

os.sched_setaffinity(0, {int(os.environ["RANK"]) % (os.cpu_count() or 1)})  # threads inherit it
world = int(os.environ["WORLD_SIZE"])
mesh = init_mesh(pp=world, timeout=60)
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(world))).double()
pipe = Pipeline(model, 4, balance=[1] * world, mesh=mesh, schedule="1f1b")
x, y = torch.randn(8, 4).double(), torch.randn(8, 4).double()
for task in os.listdir("/proc/self/task"):  # gloo's threads run only while this one waits
    if int(task) != threading.get_native_id():
        os.setpriority(os.PRIO_PROCESS, int(task), 19)
sys.setswitchinterval(60)  # a thread waiting for the GIL gets it only if this one blocks
pipe.step(x, y, loss_fn=nn.functional.mse_loss)
