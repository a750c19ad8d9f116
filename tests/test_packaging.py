"""The package as users get it: `python -m build` makes an sdist and a wheel (from the
sdist), and the wheel, installed into a fresh virtual environment, imports from there,
carries its package data (the CUDA sources) and answers a call."""
import os
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import fusedrnn

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.exhaustive
def test_the_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    version = fusedrnn.__version__
    (wheel,) = dist.glob(f"fusedrnn-{version}-py3-none-any.whl")
    assert len(list(dist.glob(f"fusedrnn-{version}.tar.gz"))) == 1
    sources = sorted(p.name for p in (ROOT / "fusedrnn" / "gpu").glob("*.cuh"))
    with zipfile.ZipFile(wheel) as z:
        assert sorted(Path(n).name for n in z.namelist() if n.endswith(".cuh")) == sources

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The wheel alone (no deps from an index): numpy, numba and threadpoolctl come from this
    # environment's site-packages, added as a path (whose .pth files, this checkout's
    # editable install among them, are not read).
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True)
    Path(purelib, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    check = textwrap.dedent(f"""
        import os
        import numpy as np
        import fusedrnn
        from fusedrnn.gpu import build
        assert fusedrnn.__file__.startswith({str(venv)!r}), fusedrnn.__file__
        assert fusedrnn.__version__ == {version!r}
        assert sorted(p.name for p in build.SOURCE_DIR.glob("*.cuh")) == {sources!r}
        n = fusedrnn.param_size(mode="gru", input_size=3, state_size=4)
        out = fusedrnn.RNN(np.ones((2, 1, 3), np.float32), np.full(n, 0.1, np.float32),
                           state_size=4, num_layers=1, mode="gru")
        assert out.shape == (2, 1, 4) and np.isfinite(out).all()
        print("ok", fusedrnn.cache_info().backends)
        from fusedrnn.cpu import warm   # (a user's would go on filling the cache)
        warm.READY.stop()
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FUSEDRNN_FIRST_TIER")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")   # a new user's empty kernel cache
    done = subprocess.run([str(python), "-c", check], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")
