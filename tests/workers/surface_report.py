import os
import sys

line = " ".join(["report", __name__, os.environ["RANK"], *sys.argv[1:]])
os.write(1, (line + "\n").encode())
