"""The schedule IR: pipeline schedules as pure data, built, validated, simulated, rendered."""

from pipesched.schedule.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action, Kind
from pipesched.schedule.builders import SCHEDULES, get_schedule, stages_per_worker
from pipesched.schedule.costs import Costs
from pipesched.schedule.dataflow import Message, data_predecessor, message_in, message_out
from pipesched.schedule.limits import MAX_ACTIONS
from pipesched.schedule.schedule import Schedule
from pipesched.schedule.simulate import simulate
from pipesched.schedule.text import render_schedule, render_timeline
from pipesched.schedule.timeline import Event, Timeline
from pipesched.schedule.transfers import Recv, Send, transfer_plan

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "MAX_ACTIONS",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "Costs",
    "Event",
    "Kind",
    "Message",
    "Recv",
    "Schedule",
    "Send",
    "Timeline",
    "data_predecessor",
    "get_schedule",
    "message_in",
    "message_out",
    "render_schedule",
    "render_timeline",
    "simulate",
    "stages_per_worker",
    "transfer_plan",
]
