# vLLM with Hybrid HiSparse: the upstream OpenAI-compatible server image with its
# vllm package replaced by this distribution's CUDA wheel.
#
# Build with `make image` (it builds dist/<wheel> first). The two defaults below
# must equal upstream.toml's pin and `make wheel FLAVOUR=cuda`'s output; a test
# holds them to that.
ARG VLLM_VERSION=0.29.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

ARG HISPARSE_WHEEL=vllm-0.29.0+hisparse.1-cp38-abi3-manylinux_2_32_x86_64.whl
COPY dist/${HISPARSE_WHEEL} /tmp/

# Same requirements as the upstream vllm it replaces, so no dependency changes:
# swap the package, then prove the overlay imports.
RUN python3 -m pip install --no-cache-dir --no-deps --force-reinstall "/tmp/${HISPARSE_WHEEL}" \
    && rm "/tmp/${HISPARSE_WHEEL}" \
    && python3 -c "import vllm.config.hisparse, vllm; print(vllm.__version__)"

ENTRYPOINT ["vllm", "serve"]
