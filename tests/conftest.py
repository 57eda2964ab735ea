import os
import sys

# Tests import helpers from this folder (tests/distributed.py).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
