"""fedelastic's tests, laid out like the package.

unit/ (and unit/<subpackage>/: sim, fl, runtime, data, strategies) checks one module against hand
computations; contract/ runs the strategy contract over the registry; integration/ runs whole
scenarios, the command line, the Python API, the Flower App and every Ray test; perf/ holds the
performance checks and the benchmark harnesses' tests (marker ``perf``: ``-m "not perf"`` skips
them). Fixtures are in conftest.py, plain helpers in support.py; no test module imports another.
"""
