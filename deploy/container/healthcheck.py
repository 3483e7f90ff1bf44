"""The image's HEALTHCHECK: exit 0 when diffuserve's /health answers 200, else 1 with one line (Docker keeps it in
`docker inspect`). /health is 503 while the model loads and warms up and while draining on SIGTERM.

The address is $DIFFUSERVE_HEALTH_URL (the image sets http://127.0.0.1:30010/health; change it with --port). Only
the standard library: it runs with the image's Python and nothing else (slim images have no curl).
"""

import os
import sys
import urllib.error
import urllib.request

URL = os.environ.get("DIFFUSERVE_HEALTH_URL", "http://127.0.0.1:30010/health")

try:
    with urllib.request.urlopen(URL, timeout=8) as response:
        status = response.status
except urllib.error.HTTPError as exc:
    status = exc.code
except OSError as exc:
    sys.exit(f"unhealthy: {URL}: {exc}")
sys.exit(0 if status == 200 else f"unhealthy: {URL} answered {status}")
