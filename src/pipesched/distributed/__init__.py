"""Running a Pipeline across processes: the data x pipeline mesh and what goes with it."""

from pipesched.distributed.mesh import MeshInfo, init_mesh

__all__ = ["MeshInfo", "init_mesh"]
