# Stage 6: the report, rendered from the JSON files earlier rules wrote.


rule report:
    input:
        unpack(report_inputs),
    output:
        html="report/{run}/r013.html",
    params:
        # the study as the page shows it (labels and title included; operational keys are not)
        config=report_params(config),
    log:
        "logs/{run}/report/report.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/report.yaml"
    script:
        "../scripts/report.py"


# report/r013.html, the target of the README's main command: a copy of the configured study's page (each
# study's own stays at report/<run>/r013.html). `run` is its param, so switching studies refreshes it.
rule report_latest:
    input:
        report_file(config).as_posix(),
    output:
        "report/r013.html",
    params:
        run=RUN,
    log:
        "logs/report_latest.log",
    localrule: True
    shell:
        "cp {input} {output} 2> {log}"
