"""The package installs as `longrun` from platform/ without shadowing the stdlib `platform`."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Every directory of platform/ with an __init__.py, dotted: found, not listed, so a new
# sub-package that pyproject.toml forgets fails the wheel test below.
SUBPACKAGES = sorted(".".join(init.parent.relative_to(REPO / "platform").parts)
                     for init in (REPO / "platform").rglob("__init__.py"))


def test_subpackages_are_found():
    assert {"controller", "worker", "trainer", "trainer.cp"} <= set(SUBPACKAGES)


def test_platform_dir_is_not_a_package(repo_root):
    assert not (repo_root / "platform" / "__init__.py").exists()


@pytest.mark.parametrize("argv", [
    ["-c", "import platform; print(platform.__file__); print(platform.system())"],
    ["-m", "platform"],  # `python -m` puts the working directory first on sys.path
])
def test_stdlib_platform_is_not_shadowed_from_repo_root(repo_root, argv):
    out = subprocess.run([sys.executable, *argv], cwd=repo_root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if argv[0] == "-c":
        path, system = out.stdout.split()
        assert Path(path).parent == Path(sysconfig.get_paths()["stdlib"])
        assert system == "Linux"


def test_torch_imports_from_repo_root(repo_root):
    # torch imports the stdlib `platform`; this is what a shadowing package breaks first.
    out = subprocess.run([sys.executable, "-c", "import torch, ray; print(torch.__version__)"],
                         cwd=repo_root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_wheel_installs_and_imports_every_subpackage(repo_root, tmp_path):
    """Build a real (non-editable) wheel, install it into a fresh venv, import everything."""
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(repo_root)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.glob("longrun-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Install the wheel's files with this interpreter's pip into the fresh venv's site-packages.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site,
         str(wheel)],
        capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    # Dependencies (torch, ray, ...) come from the test venv, appended *after* the wheel's
    # site-packages and without its .pth files, so the editable install cannot answer.
    deps = sysconfig.get_paths()["purelib"]
    (Path(site) / "zz_test_deps.pth").write_text(deps + "\n")

    code = ("import importlib, longrun; "
            f"mods = [importlib.import_module('longrun.' + m) for m in {SUBPACKAGES!r}]; "
            "import longrun.cli, longrun.doctor; "
            "print(*[m.__file__ for m in mods], sep='\\n')")
    out = subprocess.run([py, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert len(files) == len(SUBPACKAGES)
    assert all(f.startswith(site) for f in files), files
    assert not any("platform" in Path(f).parts for f in files)

    cli = subprocess.run([py, "-m", "longrun.cli", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode == 0 and "longrun 0." in cli.stdout, cli.stderr


def test_the_modules_between_the_trainer_and_the_model_import_on_their_own(repo_root):
    """`longrun.parallel` builds on the trainer's model while the trainer builds on it: each of
    its modules (and the model) must import first in a fresh interpreter, not only after the
    trainer (an import cycle hides behind whichever module a process happens to import first)."""
    # The model, and the parallel modules that import it (directly or through the pipeline).
    modules = ["longrun.trainer.model", "longrun.parallel.pipeline", "longrun.parallel.parallelize",
               "longrun.parallel.tensor_parallel"]
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=repo_root,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for m in modules}
    failed = {m: p.communicate()[1].strip().splitlines()[-1:] for m, p in procs.items()
              if p.wait() != 0}
    assert not failed, failed
