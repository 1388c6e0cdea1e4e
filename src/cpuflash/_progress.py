"""A tiny progress bar for long sweeps: on stderr, and only when stderr is a terminal (logs,
pipes and ``--json`` output stay clean). No dependency."""
import sys
import time


class Progress:
    """``with Progress(total, "label") as bar: for x in xs: bar.step(f"x={x}"); work(x)``.

    ``step`` announces the next item: the bar shows how many were started and what runs now.
    """

    def __init__(self, total, label="", stream=None, width=30, enabled=True):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done, self.start = 0, time.perf_counter()

    def __enter__(self):
        return self

    def step(self, note=""):
        self.done = min(self.total, self.done + 1)
        if not self.enabled:
            return
        filled = self.width * (self.done - 1) // self.total
        elapsed = time.perf_counter() - self.start
        line = (f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{self.done}/{self.total} {elapsed:4.0f} s  {note}")
        self.stream.write(line[:100].ljust(100))
        self.stream.flush()

    def close(self):
        """Erase the bar (the terminal line is left empty for what prints next)."""
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def __exit__(self, *exc):
        self.close()
        return False
