import os
import site

if "LOCAL_RANK" in os.environ:  # a worker or a standby, not the supervisor itself
    os.environ.setdefault("SITE_SETDEFAULT", "lr" + os.environ["LOCAL_RANK"])
    os.environ["SITE_SAW_RANK"] = os.environ.get("RANK", "unset")
    site.addsitedir(os.path.join(os.path.dirname(__file__), "pthdir"))
