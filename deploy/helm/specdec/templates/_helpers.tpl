{{/*
Expand the name of the chart.
*/}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
Component names append "-<component>", so the prefix is cut to 50 characters.
*/}}
{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" . }}
{{ include "specdec.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specdec
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels
*/}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Name of one component's objects. Call with (dict "root" $ "component" "draft").
*/}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root) .component }}
{{- end }}

{{/*
Labels of one component's objects. Call with (dict "root" $ "component" "draft").
*/}}
{{- define "specdec.componentLabels" -}}
{{ include "specdec.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "root" $ "component" "draft").
*/}}
{{- define "specdec.componentSelectorLabels" -}}
{{ include "specdec.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
In-cluster DNS name of one component's Service. Call with (dict "root" $ "component" "draft").
*/}}
{{- define "specdec.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "specdec.componentName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/*
How the coordinator finds one role's replicas (a --draft / --target spec), per coordinator.discovery:
"dns" resolves the role's headless Service again and again; "kubernetes" watches its EndpointSlices
through the Kubernetes API. Call with (dict "root" $ "component" "draft").
*/}}
{{- define "specdec.replicaSpec" -}}
{{- $port := int (index .root.Values .component).port }}
{{- if eq .root.Values.coordinator.discovery "kubernetes" }}
{{- printf "k8s:///%s/%s:%d" .root.Release.Namespace (include "specdec.componentName" .) $port }}
{{- else }}
{{- printf "dns:///%s:%d" (include "specdec.serviceHost" .) $port }}
{{- end }}
{{- end }}

{{/*
The specdec image for a pod; GPU pods get the CUDA variant. Call with (dict "root" $ "gpus" N).
*/}}
{{- define "specdec.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag }}
{{- if gt (int .gpus) 0 }}
{{- $tag = printf "%s%s" $tag .root.Values.image.cudaSuffix }}
{{- end }}
{{- printf "%s:%s" .root.Values.image.repository $tag }}
{{- end }}

{{/*
Redis URL when it is a plain value (bundled Redis, or redis.externalUrl); empty when it comes from a Secret.
*/}}
{{- define "specdec.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s://%s:%d/%d" (ternary "rediss" "redis" (eq .Values.redis.tls.enabled true)) (include "specdec.serviceHost" (dict "root" . "component" "redis")) (int .Values.redis.port) (int .Values.redis.db) }}
{{- else if not .Values.redis.externalUrlSecret.name }}
{{- required "redis.externalUrl (or redis.externalUrlSecret.name) is required when redis.enabled is false" .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/*
OTLP endpoint the services export traces to; empty means no export.
*/}}
{{- define "specdec.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint }}
{{- .Values.tracing.otlpEndpoint }}
{{- else if .Values.jaeger.enabled }}
{{- printf "%s:4317" (include "specdec.serviceHost" (dict "root" . "component" "jaeger")) }}
{{- end }}
{{- end }}

{{/*
Model a draft speaks: its own model (kind "model"), a distilled draft folder (kind "feature"; the
image ships the default target's under /opt/specdec/drafts), or the target's tokenizer model ("ngram").
*/}}
{{- define "specdec.draftModel" -}}
{{- if eq .Values.draft.kind "model" }}
{{- required "draft.model is required when draft.kind is \"model\"" .Values.draft.model }}
{{- else if eq .Values.draft.kind "feature" }}
{{- default "/opt/specdec/drafts/smollm2-135m-feature" .Values.draft.model }}
{{- else }}
{{- default .Values.target.model .Values.draft.model }}
{{- end }}
{{- end }}

{{/*
Refuses termination grace periods that do not cover the preStop sleep plus the drain.
Call with (dict "name" "draft" "cfg" .Values.draft).
*/}}
{{- define "specdec.checkGrace" -}}
{{- $need := add (int .cfg.preStopSleepSeconds) (int (ceil .cfg.drainSeconds)) }}
{{- if le (int .cfg.terminationGracePeriodSeconds) (int $need) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must be greater than preStopSleepSeconds + drainSeconds (%d)" .name (int .cfg.terminationGracePeriodSeconds) (int $need)) }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding the Redis password (redis.auth): the existing one, or the chart's.
*/}}
{{- define "specdec.redisAuthSecret" -}}
{{- default (include "specdec.componentName" (dict "root" . "component" "redis-auth")) .Values.redis.auth.existingSecret }}
{{- end }}

{{/*
The TLS pieces of a draft or target pod serving the coordinator over TLS (backendTls), as a dict of
lists "env", "volumes", "mounts", and "probePort". Call with (dict "root" $ "component" "draft").
*/}}
{{- define "specdec.backendTls" -}}
{{- $b := .root.Values.backendTls }}
{{- $cfg := index .root.Values .component }}
{{- $out := dict "env" list "volumes" list "mounts" list "probePort" (int $cfg.port) }}
{{- if $b.enabled }}
{{- $secret := index $b (printf "%sSecretName" .component) }}
{{- $secret = required (printf "backendTls.%sSecretName is required when backendTls.enabled" .component) $secret }}
{{- if has (int $b.healthPort) (list (int $cfg.port) (int .root.Values.metrics.port)) }}
{{- fail "backendTls.healthPort must differ from the draft's and target's gRPC and metrics ports" }}
{{- end }}
{{- $env := list (dict "name" "SPECDEC_TLS_CERT" "value" "/etc/specdec/tls/tls.crt") (dict "name" "SPECDEC_TLS_KEY" "value" "/etc/specdec/tls/tls.key") (dict "name" "SPECDEC_HEALTH_PORT" "value" (toString (int $b.healthPort))) }}
{{- $volumes := list (dict "name" "tls" "secret" (dict "secretName" $secret)) }}
{{- $mounts := list (dict "name" "tls" "mountPath" "/etc/specdec/tls" "readOnly" true) }}
{{- if $b.mutual.enabled }}
{{- $ca := required "backendTls.ca.secretName is required when backendTls.mutual.enabled" $b.ca.secretName }}
{{- $env = append $env (dict "name" "SPECDEC_TLS_CLIENT_CA" "value" (printf "/etc/specdec/backend-ca/%s" $b.ca.key)) }}
{{- $volumes = append $volumes (dict "name" "backend-ca" "secret" (dict "secretName" $ca)) }}
{{- $mounts = append $mounts (dict "name" "backend-ca" "mountPath" "/etc/specdec/backend-ca" "readOnly" true) }}
{{- end }}
{{- $out = dict "env" $env "volumes" $volumes "mounts" $mounts "probePort" (int $b.healthPort) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/*
--kv-budget-mb of a draft or target; "auto" (a third of the pod's memory limit, read from its cgroup)
needs that limit. Call with (dict "name" "draft" "cfg" .Values.draft).
*/}}
{{- define "specdec.kvBudget" -}}
{{- $v := .cfg.kvBudgetMb }}
{{- $budget := "auto" }}
{{- if kindIs "string" $v }}{{ $budget = $v }}{{ else if not (kindIs "invalid" $v) }}{{ $budget = toString (int $v) }}{{ end }}
{{- if and (eq $budget "auto") (not (and .cfg.resources .cfg.resources.limits .cfg.resources.limits.memory)) }}
{{- fail (printf "%s.resources.limits.memory is required when %s.kvBudgetMb is auto: the KV budget is a third of the pod's memory limit (or set %s.kvBudgetMb to a number of MiB)" .name .name .name) }}
{{- end }}
{{- $budget }}
{{- end }}
