"""The op library loads on any build of its torch; the CUDA kernels (a second library) load only
when torch has CUDA of the major version they were built for, with one warning saying why not. A
checkout without a library of its own loads the installed package's, and says when the two were
built from different C++ sources."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import megatron_eopt as me
from megatron_eopt import _library


def test_no_cuda_library_means_cpu_only_build():
    handle, why = _library.load_cuda_kernels(candidates=[], torch_cuda="13.0")
    assert handle is None and "no CUDA kernels" in why


def test_cpu_only_torch_does_not_load_the_cuda_kernels():
    handle, why = _library.load_cuda_kernels(candidates=[(13, "/nonexistent/_C_cuda13.so")], torch_cuda=None)
    assert handle is None and "CPU-only build" in why and "CUDA 13" in why


def test_other_cuda_major_does_not_load_them():
    handle, why = _library.load_cuda_kernels(candidates=[(12, "/nonexistent/_C_cuda12.so")], torch_cuda="13.0")
    assert handle is None and "uses CUDA 13.0, but the CUDA kernels were built for CUDA 12" in why


def test_a_library_that_cannot_load_is_reported(tmp_path):
    broken = tmp_path / "_C_cuda13.so"
    broken.write_bytes(b"not an ELF file")
    handle, why = _library.load_cuda_kernels(candidates=[(13, str(broken))], torch_cuda="13.0")
    assert handle is None and "could not be loaded" in why


def test_status_matches_what_was_loaded():
    info = _library.build_info()
    assert me.cuda_kernels_built() == (info["cuda_status"] == "loaded") == (info["cuda"] is not None)
    if _library._cuda_library_candidates() and torch.version.cuda is not None:
        built = {m for m, _ in _library._cuda_library_candidates()}
        assert me.cuda_kernels_built() == (int(torch.version.cuda.split(".")[0]) in built)


def test_cpu_ops_work_under_a_cpu_only_torch_with_one_warning():
    # torch.version.cuda = None is what a CPU build of torch reports.
    code = (
        "import warnings, torch\n"
        "torch.version.cuda = None\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import megatron_eopt as me\n"
        "msgs = [str(x.message) for x in w if 'megatron_eopt' in str(x.message)]\n"
        "x = me.newton_schulz(torch.randn(8, 5), precision='highest')\n"
        "print(len(msgs)); print(me.cuda_kernels_built()); print(tuple(x.shape)); print(msgs[0] if msgs else '')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stderr
    count, built, shape, message = proc.stdout.splitlines()[:4]
    assert built == "False" and shape == "(8, 5)"
    if _library._cuda_library_candidates():
        assert count == "1" and "CPU-only build" in message
    else:
        assert count == "0"


# Mangled-name prefixes of torch's C++ namespaces (c10::, at::, torch::, caffe2::): a library on the
# stable ABI imports none of them, only torch's C shim (aoti_torch_*, torch_*).
_TORCH_CXX_PREFIXES = ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch", "_ZN6caffe2")


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="needs binutils")
def test_libraries_use_only_the_stable_abi():
    libraries = glob.glob(os.path.join(_library.LIBRARY_DIR, "_C*.so"))
    assert libraries
    for path in libraries:
        undefined = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True,
                                   check=True).stdout.split()
        cxx = [name for name in undefined if name.startswith(_TORCH_CXX_PREFIXES)]
        assert not cxx, f"{os.path.basename(path)} imports torch C++ symbols: {cxx[:5]}"
        assert any(name.startswith("aoti_torch_") for name in undefined), "not linked to torch's C shim"
        needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        for lib in ("libc10.so", "libtorch_python.so", "libtorch.so]"):
            assert lib not in needed, f"{os.path.basename(path)} needs {lib}"


def test_call_op_raises_the_checks_python_type():
    from megatron_eopt._errors import call_op, typed_error

    x = torch.randn(8, 4)
    split = torch.ops.megatron_eopt.newton_schulz_split
    # Checked by the composite op itself, before its nested newton_schulz calls (torch 2.11 and
    # 2.12 drop the message of an error raised inside a nested dispatcher call).
    with pytest.raises(RuntimeError, match="^ValueError: newton_schulz: steps must be at least 1, got 0$"):
        split(x, [4, 4], 1, [1.0, 2.0, 3.0], 0, False, 1e-7, None, "highest", None, 1.0, "auto")
    with pytest.raises(ValueError) as info:
        call_op(split, x, [4, 4], 1, [1.0, 2.0, 3.0], 0, False, 1e-7, None, "highest", None, 1.0, "auto")
    assert str(info.value) == "newton_schulz: steps must be at least 1, got 0"
    with pytest.raises(TypeError, match=r"^newton_schulz_list: xs\[1\] must be float32, got Half$"):
        call_op(torch.ops.megatron_eopt.newton_schulz_list, [x, x.half()], [1.0, 2.0, 3.0], 1, False, 1e-7, None,
                "highest", "auto")
    # torch 2.13+ appends where a nested dispatcher call failed: not part of the typed message.
    nested = RuntimeError("ValueError: newton_schulz: eps must be positive (originally from "
                          "torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION) API call failed)")
    assert str(typed_error(nested)) == "newton_schulz: eps must be positive"
    assert isinstance(typed_error(nested), ValueError)

    def failing():
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError, match="^CUDA error: out of memory$"):  # other errors pass unchanged
        call_op(failing)


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HAS_SOURCES = os.path.isfile(os.path.join(ROOT, "cmake", "SourceManifest.cmake"))


def _manifest_text(manifest: dict[str, str]) -> str:
    return "".join(f"{digest}  {path}\n" for path, digest in manifest.items())


@pytest.mark.skipif(not HAS_SOURCES or shutil.which("cmake") is None, reason="needs the checkout's sources and cmake")
def test_cmake_and_python_list_the_same_sources(tmp_path):
    out = tmp_path / "sources.sha256"
    subprocess.run(["cmake", f"-DROOT={ROOT}", f"-DOUT={out}", "-P", os.path.join(ROOT, "cmake", "SourceManifest.cmake")],
                   check=True, capture_output=True, timeout=60)
    manifest = _library.source_manifest(ROOT)
    assert "CMakeLists.txt" in manifest and "csrc/ops/registration.cpp" in manifest
    assert out.read_text() == _manifest_text(manifest)


def _fake_checkout(tmp_path, sources: dict[str, str]):
    """A checkout whose package has no library (``<tmp>/checkout``) and an installed package with a
    placeholder one (``<tmp>/site``), recording ``sources`` as the checkout's."""
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    (checkout / "megatron_eopt").mkdir(parents=True)
    (checkout / "csrc").mkdir()
    (checkout / "CMakeLists.txt").write_text("project(x)\n")
    (checkout / "csrc" / "a.cpp").write_text("int a;\n")
    (site / "megatron_eopt").mkdir(parents=True)
    (site / "megatron_eopt" / "_C.so").write_bytes(b"")
    (site / "megatron_eopt" / "_C_sources.sha256").write_text(_manifest_text(sources))
    return checkout, site


def test_a_checkout_without_a_library_finds_the_installed_one(tmp_path, monkeypatch, recwarn):
    checkout, site = _fake_checkout(tmp_path, {})
    monkeypatch.setattr(_library, "_HERE", str(checkout / "megatron_eopt"))
    monkeypatch.setattr(sys, "path", [str(checkout), str(site)])
    (site / "megatron_eopt" / "_C_sources.sha256").write_text(_manifest_text(_library.source_manifest(str(checkout))))
    assert _library._find_library() == str(site / "megatron_eopt" / "_C.so")
    assert not [w for w in recwarn if "megatron_eopt" in str(w.message)]
    (site / "megatron_eopt" / "_C_sources.sha256").unlink()  # a build that does not record its sources
    assert _library._find_library() == str(site / "megatron_eopt" / "_C.so")
    assert not [w for w in recwarn if "megatron_eopt" in str(w.message)]


def test_other_sources_than_the_installed_librarys_are_named(tmp_path, monkeypatch):
    checkout, site = _fake_checkout(tmp_path, {})
    monkeypatch.setattr(_library, "_HERE", str(checkout / "megatron_eopt"))
    monkeypatch.setattr(sys, "path", [str(checkout), str(site)])
    built_from = _library.source_manifest(str(checkout))
    built_from["csrc/a.cpp"] = "0" * 64  # edited since
    built_from["csrc/gone.cpp"] = "1" * 64  # deleted since
    (site / "megatron_eopt" / "_C_sources.sha256").write_text(_manifest_text(built_from))
    (checkout / "csrc" / "new.cu").write_text("")  # added since
    with pytest.warns(RuntimeWarning, match=re.escape("built from other C++ sources (csrc/a.cpp, csrc/gone.cpp, "
                                                      "csrc/new.cu differ)")):
        assert _library._find_library() == str(site / "megatron_eopt" / "_C.so")
    (checkout / "csrc" / "new.cu").unlink()
    del built_from["csrc/gone.cpp"]
    (site / "megatron_eopt" / "_C_sources.sha256").write_text(_manifest_text(built_from))
    with pytest.warns(RuntimeWarning, match=re.escape("built from other C++ sources (csrc/a.cpp differs)")):
        _library._find_library()


def test_no_library_anywhere_says_how_to_build_one(tmp_path, monkeypatch):
    checkout, _ = _fake_checkout(tmp_path, {})
    monkeypatch.setattr(_library, "_HERE", str(checkout / "megatron_eopt"))
    monkeypatch.setattr(sys, "path", [str(checkout)])
    with pytest.raises(ImportError, match="no installed megatron_eopt on sys.path has one; install the package"):
        _library._find_library()


def test_a_checkout_run_from_its_directory_uses_the_installed_library(tmp_path):
    """End to end: Python started in a checkout without a library (its package first on sys.path)
    loads the installed libraries, runs an op, and warns once where the C++ sources differ."""
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    shutil.copytree(os.path.dirname(me.__file__), checkout / "megatron_eopt",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "_C_sources.sha256"))
    (checkout / "csrc").mkdir()
    (checkout / "csrc" / "a.cpp").write_text("int a;\n")
    (checkout / "CMakeLists.txt").write_text("project(x)\n")
    (site / "megatron_eopt").mkdir(parents=True)
    for path in glob.glob(os.path.join(_library.LIBRARY_DIR, "_C*.so")):
        os.symlink(path, site / "megatron_eopt" / os.path.basename(path))
    (site / "megatron_eopt" / "_C_sources.sha256").write_text("0" * 64 + "  csrc/a.cpp\n")
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import megatron_eopt as me, torch\n"
        "stale = [str(x.message) for x in w if 'other C++ sources' in str(x.message)]\n"
        "print(me.__file__); print(me.LIBRARY_PATH); print(len(stale))\n"
        "print(tuple(me.newton_schulz(torch.randn(8, 5), precision='highest').shape))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    package, library, stale, shape = proc.stdout.splitlines()[-4:]
    assert package == str(checkout / "megatron_eopt" / "__init__.py")
    assert library == str(site / "megatron_eopt" / "_C.so")
    assert stale == "1" and shape == "(8, 5)"
