"""A minimal kopf operator for the test bed test: records every Probe it sees."""

import os
from pathlib import Path

import kopf

SEEN = Path(os.environ["PROBE_SEEN_FILE"])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: object) -> None:
    settings.posting.enabled = False


@kopf.on.create("testbed.singleton.dev", "v1", "probes")
def seen(name: str, spec: dict[str, object], **_: object) -> dict[str, str]:
    with SEEN.open("a") as out:
        out.write(f"{name} {spec.get('size')}\n")
    return {"message": f"seen {name}"}
