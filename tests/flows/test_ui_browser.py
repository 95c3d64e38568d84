"""The UI trigger, clicked (issue 25): `longstraw ui` and `longstraw serve` (which registers the nightly deployment)
run here on 127.0.0.1; headless Chromium, driven by Selenium, opens the deployment's page in the Prefect UI, starts
a custom run with `steps` changed in its form, and watches the flow run complete; the MLflow UI then lists the
run's nested stage runs. Needs Debian's `chromium` and `chromium-driver` (`make test` installs them where apt-get
is usable); skipped without them. LONGSTRAW_SCREENSHOTS=docs/img rewrites the screenshots of docs/pipeline.md."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

pytest.importorskip("prefect")
pytest.importorskip("mlflow")
pytest.importorskip("selenium", reason="selenium is not installed (it is in the dev extras: pip install -e '.[dev]')")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import (  # noqa: E402
    ElementClickInterceptedException,
    ElementNotInteractableException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from flows.ui import free_port, stop_process  # noqa: E402
from tests.flows.test_serve import ROOT, registered, serving  # noqa: E402
from tests.flows.test_train_flow import config  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="Chromium is not installed: apt-get install chromium chromium-driver (`make test` does where it can)")

# headless as root on a closed network: without the background-networking flags Chromium's own connections
# (updates, sync, field trials) are refused en masse and slow it down
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1300")  # pages 1400 x 1157: the run form's `steps` and all nested runs in view
# No wall-clock margin a loaded machine can miss: every wait below is for a condition, bounded generously, and the
# whole test fails only when no step has completed for STALL_S (it takes 60-110 s on a shared 2-core machine, and
# timed out waiting 60 s for one element during a whole `make test` there).
STALL_S = 600
WAIT_S = 300  # one page element (the first Prefect UI page load takes ~7 s on an idle 2-core machine)
REFRESH_S = 20  # reload a page whose list should show something new by now (its own polling can lag under load)
SUBMIT_TRIES, RESUBMIT_S = 3, 60  # the form's Submit, clicked again while no run reached the server (submit())
RUN_NAME = "custom-run-from-chromium"  # typed into the form: the flow run and its MLflow parent run carry it
STAGES = {"capture", "rollout", "reward", "replay", "prompt", "optimizer"}  # nested runs each step must have


class TimeLimitExceeded(BaseException):
    """Not an Exception: no `except Exception` on the way (a polling helper, a client's retries) swallows it."""


class Watchdog:
    """TimeLimitExceeded in this (the main) thread when no step has completed for `seconds`, so that a hung page
    or server fails the test (the context managers inside still clean up); each `step` re-arms it."""

    def __init__(self, seconds: int) -> None:
        self.seconds, self.last = seconds, "the start"

    def step(self, what: str) -> None:
        self.last = what
        signal.alarm(self.seconds)

    def expire(self, signum: int, frame: object) -> None:
        raise TimeLimitExceeded(f"the browser test made no progress for {self.seconds} s after {self.last}")


@contextmanager
def watchdog(seconds: int) -> Iterator[Watchdog]:
    dog = Watchdog(seconds)
    previous = signal.signal(signal.SIGALRM, dog.expire)
    dog.step("the start")
    try:
        yield dog
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def wait_progressing(what: str, fn, progress, stall_s: float, log: Path):
    """fn()'s first value that is not None, polled each second, for as long as `progress()` (e.g. log sizes, a
    state) keeps changing within `stall_s`; else fail saying what it waited for, quoting the tail of `log`."""
    last, since = progress(), time.monotonic()
    while True:
        value = fn()
        if value is not None:
            return value
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(f"waited for {what}: no progress ({last}) for {stall_s:.0f} s; log:\n"
                                 f"{log.read_text()[-4000:]}")
        time.sleep(1.0)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


@contextmanager
def longstraw_ui(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`longstraw ui` on two free ports with its state under `tmp_path`; yields (Prefect URL, MLflow URL) once it
    reports both servers up; stops it (and so both servers) on exit."""
    pport, mport = free_port(), free_port()
    log = tmp_path / "ui.log"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.cli", "ui", "--prefect-port", str(pport), "--mlflow-port", str(mport),
           "--mlflow-store", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    ui = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        def up() -> bool | None:
            assert ui.poll() is None, f"longstraw ui exited with code {ui.returncode}:\n{log.read_text()[-4000:]}"
            return True if "Press Ctrl-C" in log.read_text() else None  # printed once both answer health checks

        wait_progressing("`longstraw ui` to report both servers up", up, lambda: _size(log), STALL_S, log)
        yield f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{mport}"
    finally:
        servers = _children(ui.pid)  # each in a session of its own, out of reach of a signal to `longstraw ui`
        stop_process(ui, timeout=30)  # SIGTERM: once serving, `longstraw ui` stops both servers and exits 0
        if ui.returncode != 0:  # killed while it started them, or it did not stop them in time
            for pid in servers:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """Headless Debian Chromium through its chromedriver, a fresh profile; both quit (process group) on exit."""
    profile = tempfile.mkdtemp(prefix="longstraw-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # chromedriver in its own process group, with Chromium below it: stop_process reaches both
    service = Service(CHROMEDRIVER, popen_kw={"start_new_session": True})
    try:
        driver = webdriver.Chrome(options=options, service=service)
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        if getattr(service, "process", None) is not None:  # started, even if the session then failed
            stop_process(service.process, timeout=5)
        shutil.rmtree(profile, ignore_errors=True)


def click(driver: webdriver.Chrome, xpath: str) -> WebElement:
    """Click the element at `xpath` once it is there and takes the click (not covered, e.g. while a toast slides
    in); returns it."""
    def attempt(d: webdriver.Chrome) -> WebElement:
        element = d.find_element(By.XPATH, xpath)
        element.click()
        return element

    not_yet = (NoSuchElementException, ElementClickInterceptedException, ElementNotInteractableException,
               StaleElementReferenceException)
    return WebDriverWait(driver, WAIT_S, ignored_exceptions=not_yet).until(
        attempt, f"{WAIT_S} s for a clickable {xpath} on {driver.current_url}")


def present(driver: webdriver.Chrome, xpath: str) -> WebElement:
    return WebDriverWait(driver, WAIT_S).until(EC.presence_of_element_located((By.XPATH, xpath)),
                                               f"{WAIT_S} s for {xpath} on {driver.current_url}")


def listed_on_page(driver: webdriver.Chrome, xpath: str, what: str) -> WebElement:
    """The element at `xpath` on a page that lists it once the server has it, reloading the page every REFRESH_S
    (its own polling lags on a loaded machine)."""
    def found(d: webdriver.Chrome) -> WebElement | None:
        for _ in range(REFRESH_S):
            if elements := d.find_elements(By.XPATH, xpath):
                return elements[0]
            time.sleep(1.0)
        d.refresh()
        return None

    return WebDriverWait(driver, WAIT_S).until(found, f"{WAIT_S} s for {what} ({xpath}) on {driver.current_url}")


def screenshot(driver: webdriver.Chrome, name: str, tmp_path: Path) -> None:
    """Into $LONGSTRAW_SCREENSHOTS (relative to the repository root) when set, else into tmp_path."""
    where = ROOT / os.environ["LONGSTRAW_SCREENSHOTS"] if os.environ.get("LONGSTRAW_SCREENSHOTS") else tmp_path
    where.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(where / name))


def submit(driver: webdriver.Chrome, client, dog: Watchdog, tmp_path: Path) -> None:
    """Click the form's Submit until the server lists the run. On a loaded machine a click once did nothing (a
    fresh clone's `make test`: no run reached the server in 300 s, the form still shown), so while the form is
    still there and the server has no run after RESUBMIT_S, Submit is clicked again, at most SUBMIT_TRIES times;
    a second run of the same name, should a slow first request land after all, is deleted."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    button = "//form//button[@type='submit']"

    def runs() -> list:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[RUN_NAME])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_ASC)

    for attempt in range(1, SUBMIT_TRIES + 1):
        click(driver, button)
        dog.step(f"submitting the form (click {attempt})")
        end = time.monotonic() + RESUBMIT_S
        while not runs() and time.monotonic() < end:
            time.sleep(1.0)
        if not runs() and not driver.find_elements(By.XPATH, button):  # the UI took the form: the server will list it
            WebDriverWait(driver, WAIT_S).until(lambda d: runs(), f"{WAIT_S} s for the API to list run {RUN_NAME}")
        if found := runs():
            for extra in found[1:]:
                client.delete_flow_run(extra.id)
            dog.step("the API listing the submitted run")
            return
    screenshot(driver, "prefect-ui-submit-failed.png", tmp_path)
    shown = " | ".join(e.text for e in driver.find_elements(
        By.XPATH, "//*[@role='alert' or @role='status' or contains(@class, 'toast') or contains(@class, 'message')]")
        if e.text.strip())
    raise AssertionError(f"{SUBMIT_TRIES} clicks on Submit, {RESUBMIT_S} s apart, and the server lists no run "
                         f"{RUN_NAME}; the page shows: {shown or 'no message'} (screenshot in {tmp_path})")


def start_custom_run(driver: webdriver.Chrome, deployment_url: str, steps: int, tmp_path: Path, client,
                     dog: Watchdog) -> str:
    """What a person does in the Prefect UI: Run -> Custom run, type a run name, double-click the value of
    `steps` in the `config` editor and type another, Submit, then click the new run. Returns the flow run
    page's URL."""
    driver.get(deployment_url)
    click(driver, "//button[normalize-space()='Run']")
    click(driver, "//*[normalize-space()='Custom run']")
    name = click(driver, "//div[contains(@class, 'flow-run-name-input')]//input")
    name.send_keys(Keys.CONTROL, "a")
    name.send_keys(RUN_NAME)
    # the editor is a transparent textarea over a highlighted copy of its text: the number's span shows where
    # to double-click, and the double-click selects it in the textarea
    number = present(driver, "//span[@class='hljs-attr' and .='\"steps\"']"
                             "/following-sibling::span[@class='hljs-number'][1]")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", number)
    ActionChains(driver).double_click(number).send_keys(str(steps)).perform()
    editor = driver.find_element(By.CSS_SELECTOR, "textarea.p-code-input__textarea")
    assert f'"steps": {steps},' in editor.get_property("value")  # the edit landed in the parameter's text
    driver.execute_script("window.scrollTo(0, 0)")  # the screenshot: run name and `steps` in one view
    screenshot(driver, "prefect-ui-custom-run.png", tmp_path)
    submit(driver, client, dog, tmp_path)
    # the new run, listed on the deployment's page
    link = listed_on_page(driver, f"//a[normalize-space()='{RUN_NAME}']", "the new run's link")
    link.click()
    WebDriverWait(driver, WAIT_S).until(EC.url_contains("/runs/flow-run/"), f"{WAIT_S} s for the run's page")
    dog.step("opening the run's page")
    return driver.current_url


def test_a_custom_run_started_in_the_prefect_ui_completes_and_mlflow_lists_its_stages(tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with watchdog(STALL_S) as dog, longstraw_ui(tmp_path) as (prefect_url, mlflow_url):
        dog.step("`longstraw ui` up")
        api = f"{prefect_url}/api"
        cfg = config(tmp_path / "run", steps=1, tracking={"uri": mlflow_url})
        # a daily cron 12 hours away: no scheduled run competes with the clicked one for the run directory
        cfg["schedule"] = {"deployment": "nightly", "cron": f"0 {(time.gmtime().tm_hour + 12) % 24} * * *"}
        cfg_path = tmp_path / "train.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        log = tmp_path / "serve.log"
        with serving(cfg_path, api, tmp_path / "prefect-home", log) as serve, \
                temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client, \
                chromium() as driver:
            dep = registered(client, "grpo-train/nightly", serve, log, timeout=WAIT_S)
            dog.step("the deployment registered")
            assert dep.parameters["config"]["steps"] == 1
            page = start_custom_run(driver, f"{prefect_url}/deployments/deployment/{dep.id}", 2, tmp_path, client,
                                    dog)
            run_id = page.split("/runs/flow-run/")[1].split("?")[0]

            def final():
                state = client.read_flow_run(run_id).state
                return state if state is not None and state.is_final() else None

            def progress():  # the serve log and the run's files grow while it trains; re-arms the watchdog
                now = (_size(log), sum(1 for _ in (tmp_path / "run").rglob("*")) if (tmp_path / "run").exists()
                       else 0, str(client.read_flow_run(run_id).state_name))
                dog.step(f"the flow run's progress {now}")
                return now

            state = wait_progressing(f"flow run {run_id} to finish", final, progress, STALL_S, log)
            run = client.read_flow_run(run_id)
            assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
            assert run.deployment_id == dep.id and run.name == RUN_NAME
            assert run.parameters["config"]["steps"] == 2  # the value typed in the form, not the deployment's 1
            # the page follows the run by itself: its state badge turns Completed; the tab lists both steps' subflows
            driver.set_window_size(1400, 1000)  # (the run graph's time axis came out garbled at 1300 in screenshots)
            listed_on_page(driver, "//*[contains(@class, 'state-badge') and normalize-space()='Completed']",
                   "the run page's Completed badge")
            dog.step("the Completed badge")
            click(driver, "//*[text()[normalize-space()='Subflow Runs']]")
            for step in (0, 1):
                present(driver, f"//a[normalize-space()='step-{step}']")
            screenshot(driver, "prefect-ui-run.png", tmp_path)

            mlflow = MlflowClient(tracking_uri=mlflow_url)
            exp = mlflow.get_experiment_by_name(cfg["tracking"]["experiment"])
            (parent,) = mlflow.search_runs([exp.experiment_id], f"attributes.run_name = 'grpo-train {RUN_NAME}'")
            assert parent.data.params["steps"] == "2" and parent.info.status == "FINISHED"
            nested = {r.info.run_name for r in mlflow.search_runs(
                [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
            for step in (0, 1):  # both steps trained: the changed `steps` took effect
                assert STAGES <= {n.split()[0] for n in nested if f" step={step} " in f"{n} "}, sorted(nested)

            driver.set_window_size(1400, 1300)
            driver.get(f"{mlflow_url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning")
            # the "+" beside the parent run's name expands its nested runs
            click(driver, f"//a[contains(@href, '/runs/{parent.info.run_id}')]/ancestor::div[@role='gridcell']"
                          "//button")
            names = "//div[@col-id='attributes.`Run Name`']//a//span"
            # for the screenshot only (the assertions read the DOM): the assistant panel closed, where this MLflow
            # has one, and the Run Name column wide enough for whole names
            for close in driver.find_elements(By.XPATH, "//button[@aria-label='Close' and "
                                                        "contains(@data-component-id, 'assistant')]"):
                close.click()
            for handle in driver.find_elements(By.CSS_SELECTOR,
                                               "[col-id='attributes.`Run Name`'] .ag-header-cell-resize"):
                ActionChains(driver).drag_and_drop_by_offset(handle, 260, 0).perform()
            WebDriverWait(driver, WAIT_S).until(lambda d: len(d.find_elements(By.XPATH, names)) > len(nested),
                                                f"{WAIT_S} s for MLflow to list the {len(nested)} nested runs")
            dog.step("MLflow listing the nested runs")
            listed = {e.get_attribute("textContent") for e in driver.find_elements(By.XPATH, names)}
            assert listed == nested | {parent.info.run_name}, sorted(listed ^ (nested | {parent.info.run_name}))
            screenshot(driver, "mlflow-ui-runs.png", tmp_path)
        assert (tmp_path / "run" / "checkpoints" / "update-000002" / "trainer.json").is_file()
