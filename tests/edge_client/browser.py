"""The pages' tests drive Chromium with bench.browser (bench.js_edge uses it too)."""

from bench.browser import Browser, chromium

__all__ = ["Browser", "chromium"]
