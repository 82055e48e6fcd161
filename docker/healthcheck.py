"""Container health: the node is up (node.json written) and, with an API port, /health answers.

``python3 healthcheck.py [--api-port 8000] [--data-dir /data]``; exit 0 healthy, 1 not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, default=Path("/data"))
    parser.add_argument("--api-port", type=int, default=int(os.environ.get("API_PORT", "0")))
    args = parser.parse_args()
    info_file = args.data_dir / "node.json"
    try:
        info = json.loads(info_file.read_text())
        os.kill(int(info["pid"]), 0)  # the node that wrote it is still running
    except (OSError, ValueError, KeyError) as exc:
        print(f"node not up: {exc}", file=sys.stderr)
        return 1
    if args.api_port:
        url = f"http://127.0.0.1:{args.api_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status != 200:
                    print(f"{url}: HTTP {reply.status}", file=sys.stderr)
                    return 1
        except OSError as exc:
            print(f"{url}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
