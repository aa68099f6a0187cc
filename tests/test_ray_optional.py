"""Ray is optional: without it the package imports and runs as before, and only asking for
the Ray backend says how to install it. Runs without Ray (no cluster needed)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import mprs_plus.backends.ray as ray_backend


def test_without_ray_the_backend_says_how_to_install_it():
    code = textwrap.dedent(
        """
        import os
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import mprs_plus
        from mprs_plus import MultiProcessingReadingService
        try:
            mprs_plus.RayBackend(address="auto")
        except ImportError as exc:
            # Run from this checkout, as the README installs it: the command names the checkout.
            checkout = os.path.dirname(os.path.dirname(os.path.abspath(mprs_plus.__file__)))
            assert f"pip install -e '{checkout}[ray]'" in str(exc), exc
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


class _Installed:
    """A distribution's metadata as pip leaves it: ``direct_url.json`` or none (an index)."""

    def __init__(self, direct_url):
        self._direct_url = direct_url

    def read_text(self, name):
        return json.dumps(self._direct_url) if name == "direct_url.json" and self._direct_url else None


def test_an_installed_copy_gets_the_command_for_where_it_came_from(tmp_path, monkeypatch):
    # The package as pip installs it: in site-packages, no setup.py above it.
    monkeypatch.setattr(ray_backend, "__file__", str(tmp_path / "site-packages/mprs_plus/backends/ray/__init__.py"))
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _Installed(None))
    assert ray_backend.install_hint("ray") == "pip install 'mprs_plus[ray]'"  # from an index: by name
    from_dir = {"url": "file:///src/my%20copy", "dir_info": {}}
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _Installed(from_dir))
    assert ray_backend.install_hint("ray") == "pip install '/src/my copy[ray]'"
