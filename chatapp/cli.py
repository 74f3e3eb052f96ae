def main():
    raise SystemExit("pdchat CLI is being built")
