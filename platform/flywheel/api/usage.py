"""The device time a run held, as training jobs' and eval runs' answers carry it (flywheel.runs.DeviceUsage)."""

from __future__ import annotations

from ninja import Field, Schema


class UsageOut(Schema):
    device: str = Field(description="What it ran on: gpu, cpu (a worker with no GPU), or empty before it ran")
    devices: int = Field(description="How many of them its last attempt held")
    wall_seconds: float = Field(description="The wall time of its work, every attempt and phase summed")
    device_hours: float = Field(description="wall time x devices held, in hours (GPU-hours when device is gpu)")
    gpu_hours: float = Field(description="device_hours when it ran on GPUs, else 0")
