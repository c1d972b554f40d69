"""namazu: an inference server for DeepSeek-V3 / Kimi-K2 class MoE models."""
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
requirements = [
    line.strip()
    for line in (here / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

setup(
    name="namazu",
    version="0.1.0",
    description="Inference server for DeepSeek-V3 / Kimi-K2 class Mixture-of-Experts models",
    packages=find_packages(include=["namazu", "namazu.*", "server", "server.*"]),
    package_data={"namazu": ["assets/**/*", "csrc/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.5", *requirements],
)
