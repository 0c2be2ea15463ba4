"""Every Python example in the docs runs, as written, against a real service (issue 32, item 10: the README's
`client.generate(...)` example promised nested lists where the client returns `Completion` objects).

An example is a ```python block whose first line is `# example: <what>`; it is run with the documented address
and `token=None` swapped for a test service's, and its own asserts are what it shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"^```python\n(# example: ([^\n(]+?)\s*(?:\(.*\))?\n.*?)^```", re.M | re.S)


def examples() -> dict[str, tuple[Path, str]]:
    found = {}
    for page in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for match in EXAMPLE.finditer(page.read_text()):
            found[match.group(2)] = (page, match.group(1))
    return found


def run_example(name: str, address: str, token: str, **names) -> None:
    page, code = examples()[name]
    documented = re.search(r'\("?\[?"(127\.0\.0\.1:\d+)"', code).group(1)
    code = code.replace(documented, address).replace("token=None", f"token={token!r}")
    exec(compile(code, f"{page.name}: {name}", "exec"), dict(names))  # noqa: S102 - our own docs


def test_the_docs_hold_the_examples_this_file_runs():
    assert set(examples()) == {"replay client", "rollout client", "verifier client"}


def test_replay_client_example(replay, auth_token_file, replay_client):
    if "my-pool" in replay_client.list_pools():
        replay_client.drop("my-pool", confirm="my-pool")
    run_example("replay client", f"127.0.0.1:{replay.port}", auth_token_file.read_text().strip())


def test_rollout_client_example(rollout, auth_token_file):
    from safetensors.torch import load_file

    weights = load_file(next(Path(rollout.engine.model_path).glob("*.safetensors")))  # the model's own weights
    run_example("rollout client", f"127.0.0.1:{rollout.port}", auth_token_file.read_text().strip(), state_dict=weights)


def test_verifier_client_example(verifier, auth_token_file):
    run_example("verifier client", f"127.0.0.1:{verifier.port}", auth_token_file.read_text().strip())
