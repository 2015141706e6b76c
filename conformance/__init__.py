"""The conformance harness: ggufpy against llama.cpp (fixtures, record, compare, report, check).

See docs/conformance.md. Only `record`, `check` and the live tests run llama.cpp (llama-cpp-python); `report`
and the golden tests read the committed files under `conformance/fixtures/` and `conformance/goldens/`.
"""
