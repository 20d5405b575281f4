"""Megatron's interactive client for the generation server: prompt, number of tokens, print the text.

    python -m megatron_train.tools.text_generation_cli localhost:5000

Reads prompts until end of input (Ctrl-D), so it also runs from a pipe.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def put_request(url: str, payload: dict, timeout: float = 600.0) -> tuple[int, dict]:
    """PUT a JSON payload; (status code, JSON answer), for errors as well as successes."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="PUT"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            return error.code, json.loads(body)
        except json.JSONDecodeError:  # e.g. a proxy's or a crashed server's plain-text page
            return error.code, {"message": body.decode(errors="replace")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m megatron_train.tools.text_generation_cli HOST:PORT", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    url = f"http://{argv[0]}/api"
    while True:
        try:
            prompt = input("Enter prompt: ")
            answer = input("Enter number tokens to generate: ")
        except EOFError:
            print()
            return 0
        try:
            tokens_to_generate = int(answer)
        except ValueError:
            print(f"Error: {answer!r} is not a whole number of tokens")
            continue
        try:
            status, body = put_request(url, {"prompts": [prompt], "tokens_to_generate": tokens_to_generate})
        except urllib.error.URLError as error:
            print(f"Error: cannot reach {url}: {error.reason}; is the server running?")
            return 1
        if status != 200:
            print(f"Error {status}: {body.get('message', body)}")
        else:
            print("Megatron Response: ")
            print(body["text"][0])


if __name__ == "__main__":
    sys.exit(main())
