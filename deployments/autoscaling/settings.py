"""What operators change at run time (`deltaserve ops budget|scale|release|autoscaler pause|resume`),
and where it lives.

The settings travel inside the Serve config, as the ``settings`` entry of the application-level
``autoscaling_policy.policy_kwargs`` (see docs/autoscaling.md, "Serve integration"). Locally an ops
command re-applies the running application's config with new settings; on Kubernetes it patches the
same YAML in the RayService's ``serveConfigV2``. Either way Serve rebuilds the policy with the new
kwargs and the next tick honours them, and the settings survive a controller restart because they
are part of the declared config.

The policy publishes what it decided on every tick as JSON (:data:`STATUS_KV_KEY` in Ray's GCS
key-value store, read by `deltaserve ops status`): per deployment the current and target replicas
and the line that explains the target.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

#: GCS internal-KV key (namespace :data:`STATUS_KV_NAMESPACE`) of the policy's last decision, JSON:
#: ``{"time": unix s, "paused": bool, "budget": float, "spent": float,
#:    "deployments": {name: {"current": int, "target": int, "wanted": int, "pinned": bool, "reason": str}}}``
STATUS_KV_KEY = b"autoscaler/status"
STATUS_KV_NAMESPACE = "deltaserve"
#: GCS internal-KV key (same namespace) of the settings `deltaserve ops` set on a running local platform,
#: JSON ``{"settings": OpsSettings, "over": the declared OpsSettings they override}``. The policy reads it
#: every tick. It is not part of the Serve config, so changing it restarts nothing, whereas new
#: ``policy_kwargs`` make Serve rebuild the application. A config applied with other declared settings
#: since wins ("over" no longer matches).
SETTINGS_KV_KEY = b"autoscaler/settings"


@dataclass(frozen=True)
class OpsSettings:
    """Run-time knobs of the autoscaler. ``budget`` None: the one the platform config sets."""

    budget: float | None = None                          # replicas (or CPUs / GPUs per the config's costs)
    pins: dict[str, int] = field(default_factory=dict)   # deployment -> fixed replicas (`ops scale`, until `release`)
    paused: bool = False                                 # targets stay where they are (`ops autoscaler pause`)

    def __post_init__(self) -> None:
        if self.budget is not None and not (isinstance(self.budget, (int, float)) and math.isfinite(self.budget)
                                            and self.budget > 0):
            raise ValueError(f"budget must be a number > 0, got {self.budget!r}")
        for name, n in self.pins.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"pin for {name!r} must be an integer >= 1, got {n!r}")
        if not isinstance(self.paused, bool):
            raise ValueError(f"paused must be true or false, got {self.paused!r}")

    def check_deployments(self, known: list[str]) -> None:
        """Raise if a pin names a deployment the autoscaler does not size."""
        unknown = sorted(set(self.pins) - set(known))
        if unknown:
            raise ValueError(f"unknown deployment {unknown[0]!r}; the autoscaler sizes {sorted(known)}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict | None) -> "OpsSettings":
        if not data:
            return cls()
        unknown = sorted(set(data) - {"budget", "pins", "paused"})
        if unknown:
            raise ValueError(f"unknown autoscaler setting {unknown[0]!r}; known: budget, pins, paused")
        return cls(budget=data.get("budget"), pins=dict(data.get("pins") or {}), paused=bool(data.get("paused", False))
                   if isinstance(data.get("paused", False), bool) else data["paused"])

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def _canonical(settings: OpsSettings) -> dict:
    return json.loads(settings.dumps())


def override_payload(settings: OpsSettings, declared: OpsSettings) -> bytes:
    """The :data:`SETTINGS_KV_KEY` value that sets ``settings`` over the config's ``declared`` ones."""
    return json.dumps({"settings": _canonical(settings), "over": _canonical(declared)}, sort_keys=True).encode()


def read_override(raw: bytes | None, declared: OpsSettings) -> OpsSettings | None:
    """The run-time settings in a :data:`SETTINGS_KV_KEY` value, or None: none set, or set over other
    declared settings than ``declared`` (a config applied since then wins). ValueError: a malformed value."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"autoscaler settings in GCS are not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("over") != _canonical(declared):
        return None
    return OpsSettings.from_json(data.get("settings"))
