"""Mesh tier, the dashboard (issue 38) in a real browser: headless Chromium (tests.browser) on the
page at / of a 2-stage mesh's `--http` port, with an API key. One mesh for every check: the page
asks for the key and takes it; it draws the plan's stages with the layers the controller's Status
gives and both nodes in the plan; a stage killed (SIGKILL), it shows the re-plan — a new history
entry, the new plan's layer bars, the node down and why; a message sent in its chat box gets the
answer the API gives for the same chat."""
from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.browser import open_chromium
from tests.localmesh import LocalMesh, free_port

pytestmark = pytest.mark.mesh

TOKEN = "browser-" + "b" * 32
WAIT_S = 120.0  # a re-plan on a loaded 2-core machine, or an answer
QUESTION = "What is the capital of France?"

STAGES_JS = """return [...document.querySelectorAll('#plan .stage-row[data-node]')]
                  .map(e => [e.dataset.node, Number(e.dataset.start), Number(e.dataset.end)])"""
NODES_JS = """return Object.fromEntries([...document.querySelectorAll('#nodes tbody tr[data-node]')]
                  .map(e => [e.dataset.node, [e.dataset.state, e.querySelector('.why').textContent]]))"""
HISTORY_JS = """return [...document.querySelectorAll('#history li')].map(e => Number(e.dataset.generation))"""


def until(driver, mesh, what: str, check, timeout: float = WAIT_S):
    """`check(driver)`'s first truthy value, polled; on a timeout, fails with the page's text and
    the mesh's logs."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(check)
    except TimeoutException:
        page = driver.find_element(By.TAG_NAME, "body").text
        raise AssertionError(f"{what}: not seen in {timeout:.0f} s. The page:\n{page[:3000]}\n{mesh.logs()}") from None


def plan_of(status) -> list[list]:
    return [[s.node_id, s.start_layer, s.end_layer] for s in status.stages]


def api_chat(http: str, question: str, max_tokens: int) -> str:
    """The answer of POST /v1/chat/completions (greedy) to one user message."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_dashboard_in_a_browser(model_dir, tmp_path):
    http = f"127.0.0.1:{free_port()}"
    keys = tmp_path / "http-keys"
    keys.write_text(f"tester {TOKEN}\n")
    os.chmod(keys, 0o600)
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(open_chromium, 1280, 1000, tmp_path / "chromedriver.log")  # beside the mesh's start
        try:
            with LocalMesh(2, model_dir, tmp_path, controller_args=("--http", http, "--http-token-file", str(keys))) \
                    as mesh:
                driver = opening.result()
                driver.get(f"http://{http}/")
                # no key yet: the events are refused and the page asks for one
                until(driver, mesh, "the key form", lambda d: d.find_element(By.ID, "key-input").is_displayed())
                driver.find_element(By.ID, "key-input").send_keys(TOKEN + "\n")

                # the plan as the controller has it: every stage's node and layers, both nodes in it
                st = mesh.controller_status()
                want = plan_of(st)
                assert len(want) == 2 and want[0][1] == 0 and want[-1][2] == 30, want
                until(driver, mesh, f"the plan's stages {want}", lambda d: d.execute_script(STAGES_JS) == want)
                nodes = until(driver, mesh, "both nodes", lambda d: len(d.execute_script(NODES_JS)) == 2
                              and d.execute_script(NODES_JS))
                assert {n: s for n, (s, _) in nodes.items()} == {"stage0": "in plan", "stage1": "in plan"}, nodes
                assert driver.execute_script(HISTORY_JS) == [st.plan_generation]

                # a stage dies: the page shows the new plan, its history entry and the node down with why
                mesh.kill("stage1")
                after = mesh.wait_plan(stages=1, generation_above=st.plan_generation, timeout=WAIT_S)
                want = plan_of(after)
                assert want == [["stage0", 0, 30]], want
                until(driver, mesh, f"the new plan's stages {want}", lambda d: d.execute_script(STAGES_JS) == want)
                history = until(driver, mesh, "the re-plan in the history", lambda d: (
                    (h := d.execute_script(HISTORY_JS))[-1:] == [st.plan_generation] and after.plan_generation in h
                    and h))
                entries = driver.find_elements(By.CSS_SELECTOR, "#history li .why")
                why = entries[history.index(after.plan_generation)].text
                assert "stage1" in why or st.stages[1].address in why, why
                _, why_out = until(driver, mesh, "stage1 down",
                                       lambda d: d.execute_script(NODES_JS).get("stage1", [""])[0] == "down"
                                       and d.execute_script(NODES_JS)["stage1"])
                assert why_out, "the page says why stage1 is out of the plan"

                # the chat box: a question, its answer streamed in, the API's own (greedy) answer
                tokens = driver.find_element(By.ID, "max-tokens")
                tokens.clear()
                tokens.send_keys("8")
                driver.find_element(By.ID, "chat-input").send_keys(QUESTION + "\n")
                done = until(driver, mesh, "the chat's answer", lambda d: d.find_elements(
                    By.CSS_SELECTOR, "#chat-log .msg.assistant[data-done]"))[0]
                assert done.get_attribute("data-done") == "1", done.text
                answer = done.find_element(By.CLASS_NAME, "text").text
                assert answer.strip() and answer == api_chat(http, QUESTION, 8).strip(), answer
                until(driver, mesh, "the chat requests in the list", lambda d: len(d.find_elements(
                    By.CSS_SELECTOR, "#requests tr.done[data-request]")) >= 2)
        finally:
            with contextlib.suppress(Exception):
                opening.result().quit()
