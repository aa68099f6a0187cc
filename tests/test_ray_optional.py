"""Ray is optional: without it the package imports and runs as before, and only asking for
the Ray backend says how to install it. Runs without Ray (no cluster needed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_ray_the_backend_says_how_to_install_it():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import mprs_plus
        from mprs_plus import MultiProcessingReadingService
        try:
            mprs_plus.RayBackend(address="auto")
        except ImportError as exc:
            assert "pip install mprs_plus[ray]" in str(exc), exc
        else:
            raise AssertionError("no ImportError")
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr


def test_importing_the_package_and_the_service_imports_no_ray():
    code = "import sys, mprs_plus, mprs_plus.reading_service, mprs_plus.backends; assert 'ray' not in sys.modules"
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
