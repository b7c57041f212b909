"""docs/dashboard.png: the dashboard of a 3-stage CPU mesh (the default model), taken with the
browser test's headless Chromium (tests.browser). It starts four stage nodes and the controller with
`--http` and an API key, drains the fourth node (a re-plan onto three stages: two history entries, a
node out of the plan), enters the key in the page, keeps a few streamed requests running, asks the
chat box one question, screenshots the whole page once every stage reports tokens/s, and stops
everything.

    python -m bench.dashboard_shot [--out docs/dashboard.png]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from logicpipe.controller.cli.model_prep import prepare_default_model
from tests.browser import chromium
from tests.localmesh import LocalMesh, free_port

TOKEN = "shot-" + "s" * 32
PROMPTS = ["Write a short poem about the sea.", "Explain what a pipeline is, in three sentences.",
           "List five uses of a lighthouse."]
WIDTH, HEIGHT = 1280, 900


def chat(http: str, prompt: str, tokens: int) -> None:
    """One streamed chat request, read to its end."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--tokens", type=int, default=160, help="new tokens of each background request")
    args = ap.parse_args()
    model = prepare_default_model()
    work = Path(tempfile.mkdtemp(prefix="dashboard-shot-"))
    keys = work / "http-keys"
    keys.write_text(f"operator {TOKEN}\n")
    os.chmod(keys, 0o600)
    http = f"127.0.0.1:{free_port()}"
    with LocalMesh(4, model, work, controller_args=("--http", http, "--http-token-file", str(keys))) as mesh, \
            chromium(WIDTH, HEIGHT) as driver:
        first = mesh.controller_status().plan_generation
        subprocess.run([*mesh.lpctl(), "drain", "stage3"], check=True, capture_output=True, timeout=60)
        mesh.wait_plan(stages=3, generation_above=first)
        chat(http, "Hello!", 8)  # one finished request in the list
        load = [threading.Thread(target=chat, args=(http, p, args.tokens), daemon=True) for p in PROMPTS]
        for t in load:
            t.start()
        driver.get(f"http://{http}/")
        wait = WebDriverWait(driver, 120, poll_frequency=0.2)
        wait.until(lambda d: d.find_element(By.ID, "key-input").is_displayed())
        driver.find_element(By.ID, "key-input").send_keys(TOKEN + "\n")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#plan .stage-row[data-node]")) == 3)
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("24")
        driver.find_element(By.ID, "chat-input").send_keys("What is the capital of France?\n")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chat-log .msg.assistant[data-done]"))
        # the stages' tokens/s come from their probes a second apart: wait for every stage to show some
        wait.until(lambda d: all(float(e.text) > 0 for e in d.find_elements(
            By.CSS_SELECTOR, "#plan .stage-row[data-node] [data-field=tokens_per_s]")))
        time.sleep(1.0)
        driver.find_element(By.ID, "chat-input").send_keys("Is it a big city?")  # (typed, not sent)
        # the whole page, from its top: the window's height is the page's and the browser's own bar
        height = driver.execute_script("return document.documentElement.scrollHeight + window.outerHeight"
                                       " - window.innerHeight")
        driver.set_window_size(WIDTH, height)
        driver.execute_script("document.activeElement.blur(); window.scrollTo(0, 0)")
        time.sleep(0.5)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.out)
        print(f"{args.out}: {Path(args.out).stat().st_size // 1024} KiB, {WIDTH} x {height} (mesh logs in {work})")
        for t in load:
            t.join(600)


if __name__ == "__main__":
    main()
