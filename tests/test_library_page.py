"""The Library page (frontends/library.py, frontends/static/) in a real headless browser: Debian's
chromium driven by Selenium through chromedriver, against a real `met serve` of two tiny models
registered as recipes. It renders the live model, its recipes and live figures from /metrics; a
click on a recipe's Load button swaps the model and the page then shows the new one; a
screenshot is kept (the test's tmp folder and .cache/artifacts/library.png); the browser's
console logs no error. Without chromium this fails (CI installs it: .ci/run), it never skips.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import requests

from tests.scripted_model import SERVE_ENV, make_scripted_model
from tests.serving import REPO, Server, make_tiny_chat_model

ALPHA, BRAVO = "page-alpha", "page-bravo"
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
ARTIFACT = REPO / ".cache" / "artifacts" / "library.png"


def _first(paths) -> str | None:
    return next((p for p in paths if Path(p).is_file()), None) or None


def _recipe(folder: Path, name: str, checkpoint: Path) -> None:
    (folder / f"{name}.toml").write_text(
        f'description = "{name}: a tiny test model"\ncheckpoint = "{checkpoint}"\n'
        f'family = "llama"\nformat = "bf16"\n\n[serve]\ndevice = "cpu"\nmax-seq-len = 1024\n'
        f'model-name = "{name}"\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("library")
    alpha = make_scripted_model(root / "alpha", [{"when": "Hello", "reply": "alpha " * 20}])
    bravo = make_tiny_chat_model(root / "bravo")
    recipes = root / "recipes"
    recipes.mkdir()
    _recipe(recipes, ALPHA, Path(alpha))
    _recipe(recipes, BRAVO, bravo)
    with Server(["run", str(recipes / f"{ALPHA}.toml"), "--frontends", "1",
                 "--event-log", str(root / "events")], root / "serve.log",
                env={**SERVE_ENV, "METRALE_RECIPES_PATH": str(recipes)}).serving(180) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = _first(CHROMIUM), _first(CHROMEDRIVER)
    if chromium is None or driver_path is None:
        pytest.fail("the Library page test needs Debian's chromium and chromium-driver "
                    "(apt-get install -y chromium chromium-driver; .ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _wait(predicate, timeout=60.0, what="the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:      # noqa: BLE001 - an element not rendered yet
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout}s")


def _text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def test_root_keeps_a_json_answer_for_api_clients(server):
    r = requests.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.json()["model"] == ALPHA
    page = requests.get(server.url + "/", headers={"Accept": "text/html"}, timeout=30)
    assert page.headers["content-type"].startswith("text/html")
    assert "http" not in page.text.replace("http-equiv", "")     # no external asset
    for name in ("library.js", "library.css"):
        assert requests.get(f"{server.url}/library/{name}", timeout=30).status_code == 200
    assert requests.get(f"{server.url}/library/../app.py", timeout=30).status_code == 404


def test_library_page_renders_and_swaps(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    for _ in range(3):        # traffic, so the live figures have something to show
        requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    browser.get(server.url + "/")
    _wait(lambda: _text(browser, "live-model") == ALPHA, what="the live model")
    assert _text(browser, "live-recipe") == ALPHA
    assert _text(browser, "swap-state") == "serving"
    rows = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#recipes tbody tr"))
    names = [r.get_attribute("data-recipe") for r in rows]
    assert {ALPHA, BRAVO} <= set(names) and "smollm2-135m-cpu" in names   # shipped ones too
    _wait(lambda: _text(browser, "fig-ttft").endswith("ms"), what="TTFT p50 from /metrics")
    assert _text(browser, "fig-kv").endswith("%")
    assert _text(browser, "fig-active") == "0"
    live_button = browser.find_element(By.CSS_SELECTOR, f'tr[data-recipe="{ALPHA}"] button')
    assert live_button.text == "live" and not live_button.is_enabled()

    browser.find_element(By.CSS_SELECTOR, f'tr[data-recipe="{BRAVO}"] button').click()
    _wait(lambda: _text(browser, "live-model") == BRAVO, what="the swapped-in model")
    _wait(lambda: "serving page-bravo" in _text(browser, "message"), what="the swap's outcome")
    assert _text(browser, "live-recipe") == BRAVO
    assert "page-alpha → page-bravo" in _text(browser, "last-swap")
    _wait(lambda: requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
          == BRAVO, what="the API serving the new model")

    shot = tmp_path / "library.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)

    logs = browser.get_log("browser")
    errors = [entry for entry in logs if entry["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
