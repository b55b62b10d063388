"""``singletonctl inject``: read manifests, inject, write them (the I/O around ``inject``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from singleton_ctl.groups import CtlError
from singleton_operator.model.inject import InjectError, Manifest, inject_manifests


def read_manifests(paths: Sequence[str]) -> list[Manifest]:
    manifests: list[Manifest] = []
    if list(paths).count("-") > 1:
        raise CtlError("-f -: stdin can be read once; give it once")
    for path in paths:
        source = "stdin" if path == "-" else path
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CtlError(f"{source}: not UTF-8 text") from None
        except OSError as exc:
            raise CtlError(f"cannot read {source}: {exc.strerror or exc}") from None
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise CtlError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None
        for index, doc in enumerate(docs):
            if doc is None:
                continue  # an empty document (a leading or doubled ---)
            if not isinstance(doc, dict):
                raise CtlError(f"{source}: document {index + 1} is not a Kubernetes object (a mapping)")
            manifests.append(Manifest(doc=doc, source=f"{source} (document {index + 1})"))
    return manifests


def inject_files(paths: Sequence[str], *, namespace: str, sidecar_image: str, pull_policy: str | None = None,
                 pull_secrets: Sequence[str] = ()) -> str:
    """All documents of ``paths`` as one YAML stream, the adopted workloads injected. Nothing
    is written unless every document was read and every injection succeeded."""
    try:
        docs = inject_manifests(read_manifests(paths), default_namespace=namespace,
                                default_sidecar_image=sidecar_image, sidecar_pull_policy=pull_policy,
                                image_pull_secrets=tuple(dict.fromkeys(pull_secrets)))
    except InjectError as exc:
        raise CtlError(str(exc)) from None
    return yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True)
