import os

if os.environ.get("PRELOAD_STARTED"):
    open(os.environ["PRELOAD_STARTED"], "w").close()
open(os.environ["PRELOAD_GATE"]).close()
