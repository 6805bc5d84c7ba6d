"""The browser fixtures of test_web.py (Debian's Chromium through Playwright, a page opener that watches
for errors, the gateway's own NEURALGRID_HOME), shared with the other page tests here."""

from tests.web.test_web import browser, gateway_settings, open_page  # noqa: F401
