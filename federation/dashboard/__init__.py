"""The operator dashboard: server-rendered pages over the federation's data.

- `nav`: the registry of navigation items (a page adds itself next to its URL in `urls.py`).
- `scoping`: which organizations a user may see (through `federation.services.visible_organizations`).
- `plots`: a plotly figure built in Python rendered into a template div (plotly.js from static/).
- `services`: the data each page shows; `views` are thin.
"""
