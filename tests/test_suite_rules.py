"""The test suite's own rules: under CI=true a skip (a missing package or ../shared file) fails the run, a
CUDA-only skip does not, and without CI=true skips stay skips; a fast run (`-m "not processes"`) fails a test
that starts a process without the `processes` marker."""

from __future__ import annotations

import pytest

SKIPPING = {
    "test_skips.py": """
        import pytest

        def test_missing_package():
            pytest.importorskip("a_package_nobody_installed")

        @pytest.mark.skipif(True, reason="needs ../shared/vocab/gpt2-vocab.json")
        def test_missing_shared_file():
            pass

        @pytest.mark.skipif(True, reason="needs a CUDA device")
        def test_cuda_only():
            pass

        def test_runs():
            pass
        """,
    "test_module_skip.py": """
        import pytest

        pytest.importorskip("another_package_nobody_installed")

        def test_never_collected():
            pass
        """,
}


@pytest.fixture
def skipping_suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(**SKIPPING)
    return pytester


def test_under_ci_a_skip_for_a_package_or_a_shared_file_fails_the_run(skipping_suite, monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = skipping_suite.runpytest_inprocess("-p", "tests.helpers.ci_skips")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert result.parseoutcomes() == {"passed": 1, "skipped": 4}  # every test still ran
    section = result.stdout.str().split("CI=true: skips fail the run")[1]
    assert "test_skips.py::test_missing_package: could not import 'a_package_nobody_installed'" in section
    assert "test_skips.py::test_missing_shared_file: needs ../shared/vocab/gpt2-vocab.json" in section
    assert "test_module_skip.py: could not import 'another_package_nobody_installed'" in section
    assert "test_cuda_only" not in section


def test_without_ci_skips_stay_skips(skipping_suite, monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = skipping_suite.runpytest_inprocess("-p", "tests.helpers.ci_skips")
    assert result.ret == pytest.ExitCode.OK
    assert result.parseoutcomes() == {"passed": 1, "skipped": 4}
    assert "CI=true" not in result.stdout.str()


@pytest.mark.processes  # its tests start a subprocess (and the outer fast run's guard would refuse them)
def test_a_fast_run_fails_a_test_that_starts_a_process_unmarked(pytester) -> None:
    pytester.makepyfile(
        test_spawns="""
        import subprocess
        import sys

        import pytest

        def test_unmarked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.processes
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_in_process():
            assert sum(range(4)) == 6
        """
    )
    pytester.makeini("[pytest]\nmarkers = processes: starts processes")
    fast = pytester.runpytest_inprocess("-p", "tests.helpers.process_guard", "-m", "not processes")
    assert fast.parseoutcomes() == {"passed": 1, "failed": 1, "deselected": 1}
    fast.stdout.fnmatch_lines(["*this test starts a process (a subprocess): mark it @pytest.mark.processes*"])
    whole = pytester.runpytest_inprocess("-p", "tests.helpers.process_guard")
    assert whole.parseoutcomes() == {"passed": 3}
