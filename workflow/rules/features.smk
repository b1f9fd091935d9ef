rule features:
    input:
        **stage_inputs("features"),
    output:
        **stage_outputs("features"),
    params:
        **stage_params("features"),
    threads: stage_threads("features")
    conda:
        "../envs/asrflow.yaml"
    log:
        "logs/features.log",
    shell:
        stage_shell("features")
