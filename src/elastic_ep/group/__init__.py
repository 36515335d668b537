"""The controller group (`elastic-ep serve --etcd URL --ha-group NAME`): controllers on several
hosts, one leader elected through an etcd lease (`election.py`), its term the fencing token every
control-plane frame carries (wire/codec.py), the others standing by (`status.py` says what each
one is). `store.py` is the one module that talks to etcd. Nothing here imports control/ or serve/:
commands/serve.py ties them together."""
