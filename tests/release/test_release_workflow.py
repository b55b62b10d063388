""".github/workflows/release.yml: actionlint (built from its Go module by
testbed/build-go-tool.sh, cached) finds nothing, shellcheck included, and the workflow
publishes what `make dist` builds, the way the release needs (no server)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import REPO_ROOT

WORKFLOW = REPO_ROOT / ".github" / "workflows" / "release.yml"


@pytest.fixture(scope="module")
def actionlint() -> Path:
    build = REPO_ROOT / "testbed" / "build-go-tool.sh"
    folder = subprocess.run(["bash", str(build), "actionlint"], capture_output=True,
                            text=True, check=True, timeout=600).stdout.strip().splitlines()[-1]
    return Path(folder) / "actionlint"


def lint(actionlint: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(actionlint), "-no-color", "-oneline", str(path)], capture_output=True, text=True,
                          check=False, cwd=REPO_ROOT)


def test_actionlint_and_shellcheck_find_nothing(actionlint: Path) -> None:
    assert shutil.which("shellcheck"), "actionlint checks run: scripts only with shellcheck on PATH"
    result = lint(actionlint, WORKFLOW)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_actionlint_is_not_blind(actionlint: Path, tmp_path: Path) -> None:
    """The same file with a job needing one that does not exist and an unquoted expansion."""
    broken = tmp_path / ".github" / "workflows" / "release.yml"
    broken.parent.mkdir(parents=True)
    text = WORKFLOW.read_text().replace("needs: [dist, pypi, chart, image]", "needs: [dist, pypi, chart, images]")
    text = text.replace('cd dist\n', 'cd $RUNNER_TEMP/dist\n')
    broken.write_text(text)
    result = lint(actionlint, broken)
    assert result.returncode == 1
    assert '"images"' in result.stdout and "SC2086" in result.stdout, result.stdout


def workflow() -> dict[Any, Any]:
    doc: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return doc


def steps_text(job: dict[str, Any]) -> str:
    return "\n".join(str(step.get("uses", "")) + "\n" + str(step.get("run", "")) for step in job["steps"])


def test_the_workflow_builds_with_make_dist_and_publishes_each_artifact() -> None:
    doc = workflow()
    assert doc[True]["push"]["tags"] == ["v[0-9]+.[0-9]+.[0-9]+"]  # YAML 1.1 reads the key `on` as true
    assert doc["permissions"] == {"contents": "read"}
    jobs = doc["jobs"]
    assert "-m singleton_testbed.dist --no-image dist" in steps_text(jobs["dist"])
    pypi = jobs["pypi"]
    assert pypi["permissions"] == {"id-token": "write"}  # trusted publishing, no token secret
    assert "pypa/gh-action-pypi-publish@" in steps_text(pypi)
    assert "helm push" in steps_text(jobs["chart"]) and "oci://ghcr.io/" in steps_text(jobs["chart"])
    (build,) = [step for step in jobs["image"]["steps"] if str(step.get("uses", "")).startswith("docker/build-push")]
    assert build["with"]["platforms"] == "linux/amd64,linux/arm64" and build["with"]["sbom"] is True
    assert "gh release create" in steps_text(jobs["github-release"])
    assert set(jobs["github-release"]["needs"]) == {"dist", "pypi", "chart", "image"}
    assert "secrets.PYPI" not in WORKFLOW.read_text()


def test_every_action_is_pinned_by_its_commit_and_names_its_release() -> None:
    """A tag can be moved to other code; a commit cannot. The comment keeps the pin readable
    (and lets Dependabot or Renovate propose the next one)."""
    uses = [line.strip() for line in WORKFLOW.read_text().splitlines() if re.match(r"\s*(- )?uses:", line)]
    assert len(uses) >= 10
    pinned = re.compile(r"(- )?uses: [\w.-]+/[\w.-]+@[0-9a-f]{40}  # v\d+\.\d+\.\d+")
    unpinned = [line for line in uses if not pinned.fullmatch(line)]
    assert not unpinned, unpinned


# Releases older than these cannot publish what `make dist` builds.
MINIMUM_RELEASES = {
    # Metadata 2.4 (setuptools >= 77 writes it for `license = "Apache-2.0"`): older releases
    # bundle a twine that refuses it ("Metadata is missing required fields: Name, Version").
    "pypa/gh-action-pypi-publish": (1, 12, 4),
}


def test_the_pinned_releases_are_new_enough_for_what_they_publish() -> None:
    pinned = dict(re.findall(r"uses: ([\w.-]+/[\w.-]+)@[0-9a-f]{40}  # v([\d.]+)", WORKFLOW.read_text()))
    for action, least in MINIMUM_RELEASES.items():
        assert tuple(int(part) for part in pinned[action].split(".")) >= least, (action, pinned[action])
