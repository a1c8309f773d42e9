from setuptools import find_packages, setup

_DEV = ["flash-linear-attention==0.6.0", "einops", "accelerate>=1.0", "peft>=0.17", "Pillow", "tiktoken",
        "bitsandbytes>=0.50", "nbclient", "nbformat", "ipykernel", "matplotlib", "compressed-tensors"]
# transformers' own server (`python -m transformers_k3 serve`) and the OpenAI client its tests talk to it with
_SERVE = ["transformers[serving]>=5.25", "uvicorn", "openai"]  # 5.25: the server classes serve.py plugs into

setup(
    name="transformers-k3",
    version="0.1.0",
    description="Kimi K3 for Hugging Face transformers: KDA + gated MLA, Block Attention Residuals, Stable Latent MoE",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    package_dir={"": "src"},
    packages=find_packages("src"),
    include_package_data=True,
    package_data={"transformers_k3": ["assets/**/*", "ops/csrc/*.cpp", "ops/csrc/*.h"]},
    python_requires=">=3.10",
    # torch is pinned loosely on purpose: a plain `torch` requirement on a machine without torch pulls a
    # multi-GB CUDA build; install the CPU wheel first (see README) and this range is already satisfied.
    install_requires=[
        "torch>=2.6",
        "transformers>=5.23,<5.26",
        "safetensors>=0.4",
        "huggingface_hub",
        "ninja",  # torch.utils.cpp_extension builds the CPU kernels with it
    ],
    extras_require={
        # [dev]: what notebooks, fine-tuning and the converters use beside the base install
        "dev": _DEV,
        # [test]: everything modeling_tests/ imports (the README's test command installs it; test_install checks it)
        "test": _DEV + _SERVE + ["pytest>=8", "hypothesis", "psutil", "deepspeed"],
        "serve": _SERVE,
        "fla": ["flash-linear-attention==0.6.0"],
        "vision": ["Pillow"],
        "quant": ["bitsandbytes>=0.50"],  # 0.50: 4-bit layers run on CPU too
    },
)
