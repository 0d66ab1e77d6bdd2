"""methods/kernels/cpu_build.py: build once into the cache, load, and say why when it cannot."""

import ctypes
import os
import subprocess
import sys

import pytest

from kvcore.errors import ConfigError
from methods.kernels import cpu_build
from tests.conftest import PROJECT


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


@pytest.mark.parametrize("flags, refused", [
    ("-Wl,-o,{tmp}/keep.txt", "-Wl,-o,{tmp}/keep.txt"),  # the linker told to write a user file
    ("-O3 -o {tmp}/keep.txt", "-o"),
    ("-MF{tmp}/deps", "-MF{tmp}/deps"),
    ("-MD", "-MD"),
    ("-specs={tmp}/specs", "-specs={tmp}/specs"),
    ("@{tmp}/args", "@{tmp}/args"),
    ("-fprofile-generate={tmp}/prof", "-fprofile-generate={tmp}/prof"),
    ("-fstack-usage", "-fstack-usage"),  # writes a .su file next to the output
    ("-fplugin=evil.so", "-fplugin=evil.so"),
    ("-DPATH=/etc/passwd", "-DPATH=/etc/passwd"),
    ("-Xlinker --output", "-Xlinker"),
    ("-mllvm -O3", "-mllvm"),
    ("-save-temps", "-save-temps"),
    ("{tmp}/other.c", "{tmp}/other.c"),
])
def test_kernel_flags_that_could_name_a_file_are_refused_before_any_build(tmp_path, monkeypatch,
                                                                          flags, refused):
    """Only what a kernel build needs passes; the refusal names the variable and the flag, and
    neither the compiler runs nor the user's file changes."""
    keep = tmp_path / "keep.txt"
    keep.write_text("a user's file\n")
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVH_KERNEL_FLAGS", flags.format(tmp=tmp_path))
    monkeypatch.setattr(cpu_build.subprocess, "run", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ConfigError) as err:
        cpu_build.check_environment()
    assert str(err.value).startswith(f"KVH_KERNEL_FLAGS: {refused.format(tmp=tmp_path)!r} is not")
    assert "\n" not in str(err.value)
    source = _source(tmp_path, "never", "int f(void) { return 1; }\n")
    with pytest.raises(ConfigError, match="KVH_KERNEL_FLAGS"):
        cpu_build.library(source, lambda lib: None)
    with pytest.raises(ConfigError, match="extra_flags"):
        cpu_build.check_flags(flags.format(tmp=tmp_path).split(), "extra_flags")
    assert keep.read_text() == "a user's file\n"


@pytest.mark.parametrize("flag", ["-O0", "-O2", "-Ofast", "-Os", "-mno-avx512f", "-march=haswell",
                                  "-mtune=generic", "-mavx2", "-DVARIANT=3", "-DNDEBUG", "-UNDEBUG",
                                  "-fno-fast-math", "-funroll-loops", "-fvect-cost-model=cheap",
                                  "-fopenmp"])
def test_kernel_build_flags_pass(flag):
    assert cpu_build.check_flags([flag], "KVH_KERNEL_FLAGS") == (flag,)


def test_kernel_cache_is_never_a_link_nor_a_users_folder(tmp_path, monkeypatch):
    """$KVH_KERNEL_CACHE is checked like an output folder: a link (even to an empty folder) or a
    folder holding files the harness did not write is refused by name, and left as it was."""
    monkeypatch.delenv("KVH_KERNEL_FLAGS", raising=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(mine))
    with pytest.raises(ConfigError, match=r"KVH_KERNEL_CACHE=.*mine holds files the harness did "
                                          r"not write \(notes.txt\)"):
        cpu_build.check_environment()
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(tmp_path / "link"))
    with pytest.raises(ConfigError, match="is a symbolic link"):
        cpu_build.check_environment()
    source = _source(tmp_path, "never", "int f(void) { return 1; }\n")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        cpu_build.library(source, lambda lib: None)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert not list((tmp_path / "empty").iterdir())
    monkeypatch.setenv("KVH_KERNEL_CACHE", " ")
    with pytest.raises(ConfigError, match="KVH_KERNEL_CACHE is set but empty"):
        cpu_build.check_environment()


def test_a_link_planted_at_the_librarys_name_is_replaced_not_followed(tmp_path, monkeypatch):
    """The compiler writes into a private folder; the library then takes its name in the cache
    by a rename, which replaces a link there instead of writing through it."""
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here")
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("KVH_KERNEL_CACHE", str(cache))
    monkeypatch.delenv("KVH_KERNEL_FLAGS", raising=False)
    source = _source(tmp_path, "planted", "int planted(void) { return 5; }\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("a user's file\n")
    name = cpu_build._build(source).name  # the name the library gets
    (cache / name).unlink()
    (cache / name).symlink_to(victim)
    cpu_build._build(source)
    assert victim.read_text() == "a user's file\n"
    assert not (cache / name).is_symlink() and not list(cache.glob(".build-*"))


def test_the_cli_refuses_hostile_kernel_flags_before_anything_loads(tmp_path):
    """`python -m harness` with linker flags naming a user's file: exit 2, one `error:` line
    naming the variable and the flag, the file untouched, no results root."""
    keep = tmp_path / "keep.txt"
    keep.write_text("a user's file\n")
    env = {**os.environ, "KVH_KERNEL_FLAGS": f"-O2 -Wl,-o,{keep}",
           "KVH_KERNEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "harness", "model=stories260k", "method=kivi",
                           f"runner.results_root={tmp_path / 'results'}"], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        line for line in done.stderr.strip().splitlines() if line.startswith("error: ")]
    assert f"error: KVH_KERNEL_FLAGS: '-Wl,-o,{keep}' is not a kernel build flag" in done.stderr
    assert keep.read_text() == "a user's file\n"
    assert not (tmp_path / "results").exists() and not (tmp_path / "cache").exists()


def test_a_default_cache_holding_other_files_is_passed_over(tmp_path, monkeypatch):
    """Without $KVH_KERNEL_CACHE, a default folder holding files the harness did not write is
    left alone and the next candidate (a temp folder) takes the build."""
    monkeypatch.delenv("KVH_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cpu_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    default = tmp_path / "home" / ".cache" / "kv-harness" / "kernels"
    default.mkdir(parents=True)
    (default / "notes.txt").write_text("mine\n")
    assert cpu_build._cache_dir() == tmp_path / "tmp" / "kv-harness-kernels"
    assert sorted(p.name for p in default.iterdir()) == ["notes.txt"]


def test_loading_a_kernel_leaves_the_processs_floating_point_alone(tmp_path):
    """A kernel compiled with -ffast-math must not switch the whole process to flush-to-zero
    when it loads (gcc < 13 links crtfastmath.o into such a library): every later torch, numpy
    or Python float op would read subnormals as 0. In a fresh process (this one may have loaded
    kernels already)."""
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here")
    source = _source(tmp_path, "twice", "double twice(double x) { return 2.0 * x; }\n")
    code = ("import ctypes, sys; from methods.kernels import cpu_build\n"
            "lib = cpu_build.library(__import__('pathlib').Path(sys.argv[1]), lambda l: None)\n"
            "assert lib is not None, cpu_build._errors\n"
            "print(float('1e-310') > 0.0, 1e-300 * 1e-10 > 0.0)\n")
    done = subprocess.run([sys.executable, "-c", code, str(source)], cwd=PROJECT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVH_KERNEL_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
