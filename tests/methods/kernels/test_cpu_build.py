"""methods/kernels/cpu_build.py: build once into the cache, load, and say why when it cannot."""

import ctypes

import pytest

from methods.kernels import cpu_build


def _source(tmp_path, name, text):
    path = tmp_path / f"{name}.c"
    path.write_text(text)
    return path


def test_builds_once_into_the_cache_and_loads(tmp_path, monkeypatch):
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here")
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(cache))
    source = _source(tmp_path, "answer", "int answer(void) { return 42; }\n")

    def declare(lib):
        lib.answer.restype = ctypes.c_int

    lib = cpu_build.library(source, declare)
    assert lib is not None and lib.answer() == 42
    assert cpu_build.library(source, declare) is lib  # once per process
    built = list(cache.glob("answer_*.so"))
    assert len(built) == 1 and not list(cache.glob("*.part"))  # written atomically


def test_no_compiler_or_a_failed_build_gives_none_and_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    missing = _source(tmp_path, "missing", "int f(void) { return 1; }\n")
    assert cpu_build.library(missing, lambda lib: None) is None
    assert "no C compiler" in cpu_build.build_error(missing)
    monkeypatch.delenv("CC")
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here")
    broken = _source(tmp_path, "broken", "int f(void) { return }\n")
    assert cpu_build.library(broken, lambda lib: None) is None
    assert "failed on broken.c" in cpu_build.build_error(broken)


def test_build_variants_are_separate_libraries(tmp_path, monkeypatch):
    """`extra_flags` and `$KVH_KERNEL_FLAGS` reach the compiler and name their own cache entry
    (a variant never hands back the default build, nor the default a variant)."""
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here")
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(cache))
    monkeypatch.delenv("KVH_KERNEL_FLAGS", raising=False)
    source = _source(tmp_path, "variant", "#ifndef VARIANT\n#define VARIANT 0\n#endif\n"
                                          "int variant(void) { return VARIANT; }\n")

    def declare(lib):
        lib.variant.restype = ctypes.c_int

    assert cpu_build.library(source, declare).variant() == 0
    assert cpu_build.library(source, declare, ("-DVARIANT=7",)).variant() == 7
    monkeypatch.setenv("KVH_KERNEL_FLAGS", "-DVARIANT=3")
    assert cpu_build.library(source, declare).variant() == 3
    assert len(list(cache.glob("variant_*.so"))) == 3
