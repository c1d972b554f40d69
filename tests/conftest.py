import os
import sys

# Test helpers (oracle checkpoint builders) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
