import os
if os.environ.get('CUDNN_VARIANT'):
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location('cudnn_variant', os.path.join(os.path.dirname(__file__), 'cudnn_variant.py'))
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
