"""The conformance harness: ggufpy against llama.cpp (fixtures, record, compare, report, check).

See docs/conformance.md. Only `record`, `check` and the live tests run llama.cpp (llama-cpp-python); `report`
and the golden tests read the committed files under `conformance/fixtures/` and `conformance/goldens/`.
"""

# the fixture catalogue: the base fixtures, then the modules that add their own specs and writers (in this order:
# fixtures_llama4 and fixtures_deepseek build on fixtures_moe), whichever of them is imported first
from . import fixtures, fixtures_hybrid, fixtures_moe, fixtures_llama4, fixtures_gemma4, fixtures_deepseek  # noqa: F401, I001
from . import fixtures_glm4moe  # noqa: F401  (builds on fixtures_moe too)
from . import fixtures_lfm2  # noqa: F401
