"""Pictures of schedules and timelines: Gantt charts (PNG, SVG) and Chrome traces.

matplotlib is imported only when a picture is drawn, so ``import pipesched.viz``
is cheap and works without it; the traces need nothing beyond the standard
library. Nothing here imports torch.
"""

from __future__ import annotations

from pipesched.viz.chrome import chrome_trace, trace_events
from pipesched.viz.comparison import gantt_comparison
from pipesched.viz.gantt import gantt

__all__ = ["chrome_trace", "gantt", "gantt_comparison", "trace_events"]
