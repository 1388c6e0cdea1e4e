"""Test runs in processes of their own, started in the background as soon as the session is
collected (conftest.py: ``pytest_collection_finish`` calls each test module's
``start_in_background(test name)``, ``pytest_sessionfinish`` its ``stop_all()``) and waited
for by their tests. Such runs mostly compile, on one core, as the suite mostly does, so on a
2-core machine they overlap with the rest of it."""
import functools
import os
import subprocess
import tempfile

# The session's own process runs most tests one after the other, on one core: it is the
# longest chain of work, and background runs that took its core from it made the whole
# session longer. They start at the lowest priority (niceness 19), so they take the other
# core and whatever the session leaves idle.
BACKGROUND_NICE = 19


class BackgroundRuns:
    """Processes keyed by test name: ``start`` one once, ``wait`` for it from its test,
    ``stop_all`` kills the ones no test waited for (a session stopped early, by -x say)."""

    def __init__(self):
        self._started = {}

    def start(self, name, argv, nice=BACKGROUND_NICE, **popen):
        """Start ``argv`` for the test ``name`` (not again while it is started), its output
        going to a temporary file, at the niceness ``nice`` (where the OS has one)."""
        if name in self._started:
            return
        log = tempfile.TemporaryFile(mode="w+")
        if nice and hasattr(os, "nice"):
            popen["preexec_fn"] = functools.partial(os.nice, nice)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, **popen)
        self._started[name] = (proc, log)

    def wait(self, name, timeout):
        """The output of the run of ``name`` once it has ended (killed after ``timeout``
        seconds); AssertionError with the end of its output if it failed."""
        proc, log = self._started.pop(name)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            log.seek(0)
            output = log.read()
            log.close()
        assert proc.returncode == 0, output[-6000:]
        return output

    def stop_all(self):
        for proc, log in self._started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        self._started.clear()
