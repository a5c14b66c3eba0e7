"""Which torch device a config's device name means, checked against the machine it runs on.

Owns the names (`cpu`, `cuda`, `cuda:N`, `auto`) and the one-line error for a device that is not there;
what runs on the device is the caller's business.
"""

from __future__ import annotations

import torch

from inflight.errors import UserError


def check_device_name(name: str, key: str = "device") -> torch.device | None:
    """The device `name` spells (None for `auto`), whichever machine it is for: a device placed elsewhere
    (on a Ray cluster) is checked against that machine by its launcher. A name other than auto, cpu, cuda
    or cuda:N is a UserError naming the config `key` and the fix."""
    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{key}={name!r} is not a device name: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"{key}={name!r}: only cpu and cuda devices are supported; use auto, cpu or cuda")
    return device


def resolve_device(name: str, key: str = "device") -> torch.device:
    """`auto` -> cuda if available, else cpu; `cpu`, `cuda`, `cuda:N` as torch spells them.

    A device this machine lacks is a UserError naming it, the config `key` that asked for it, and the fix.
    """
    device = check_device_name(name, key)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"{key}={name!r} but this machine has no CUDA device: set {key}=cpu (or auto)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UserError(
            f"{key}={name!r} but this machine has {count} CUDA device(s): use cuda:0 to cuda:{count - 1}"
        )
    return device
