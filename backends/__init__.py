"""Token engines and their worker adapters. Above `router` and `kvbm`, below the frontend."""
