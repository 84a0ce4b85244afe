{{/*
Pieces shared by the three specdec roles (coordinator, draft, target).
*/}}

{{/*
Volumes holding the model files, per model.source.
*/}}
{{- define "specdec.modelVolumes" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is \"pvc\"" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is \"hostPath\"" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "image" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.image.sizeLimit }}
{{- end }}
{{- end }}

{{/*
Mount of the model volume in a specdec container (nothing for model.source "embedded").
*/}}
{{- define "specdec.modelVolumeMounts" -}}
{{- $m := .Values.model }}
{{- if ne $m.source "embedded" }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
initContainer copying the models out of model.image (model.source "image").
*/}}
{{- define "specdec.modelInitContainers" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
- name: copy-model
  image: {{ printf "%s:%s" (required "model.image.repository is required when model.source is \"image\"" $m.image.repository) (required "model.image.tag is required when model.source is \"image\"" $m.image.tag) | quote }}
  imagePullPolicy: {{ $m.image.pullPolicy }}
  command: ["sh", "-c", {{ printf "cp -R %s/. /model-copy/" (trimSuffix "/" $m.image.path) | quote }}]
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    {{- toYaml $m.image.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /model-copy
{{- end }}
{{- end }}

{{/*
The Deployment of one specdec role. Call with a dict:
  root       the top context ($)
  component  "coordinator" | "draft" | "target"
  cfg        the role's values (.Values.<component>)
  args       list of command-line arguments after the subcommand
  gpus       nvidia.com/gpu per pod (0: none)
  threads    torch threads (OMP_NUM_THREADS)
  probePort  the port the gRPC probes use
  env        list of extra EnvVar objects (may be empty)
  volumes    list of extra Volume objects (may be empty)
  mounts     list of extra VolumeMount objects (may be empty)
  replicas   false to leave spec.replicas to an HPA
  serviceAccount  optional: the pod's own ServiceAccount, with its token mounted (default: the
             chart's shared one, per serviceAccount.*)
  http       optional: (dict "port" N "scheme" "HTTP"|"HTTPS" "probe" bool) of an HTTP API beside gRPC
             (the coordinator's): a port named http, and, with probe, readiness by GET /health on it
*/}}
{{- define "specdec.roleDeployment" -}}
{{- $root := .root }}
{{- $cfg := .cfg }}
{{- $ctx := dict "root" $root "component" .component }}
{{- include "specdec.checkGrace" (dict "name" .component "cfg" $cfg) }}
{{- $resources := deepCopy (default dict $cfg.resources) }}
{{- if gt (int .gpus) 0 }}
{{- $limits := deepCopy (default dict $resources.limits) }}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  labels:
    {{- include "specdec.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if .replicas }}
  replicas: {{ $cfg.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $cfg.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specdec.componentSelectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $cfg.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      labels:
        {{- include "specdec.componentLabels" $ctx | nindent 8 }}
        {{- with $cfg.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if .serviceAccount }}
      serviceAccountName: {{ .serviceAccount }}
      automountServiceAccountToken: true
      {{- else }}
      serviceAccountName: {{ include "specdec.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds }}
      {{- with (include "specdec.modelInitContainers" $root | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "specdec.image" (dict "root" $root "gpus" .gpus) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          command: ["specdec"]
          args:
            {{- toYaml .args | nindent 12 }}
            {{- with $cfg.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $cfg.port }}
              protocol: TCP
            {{- if ne (int .probePort) (int $cfg.port) }}
            - name: grpc-health
              containerPort: {{ .probePort }}
              protocol: TCP
            {{- end }}
            {{- with .http }}
            - name: http
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
            {{- if $root.Values.serviceMonitor.enabled }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "specdec.componentName" (dict "root" $root "component" "config") }}
          env:
            - name: OMP_NUM_THREADS
              value: {{ .threads | quote }}
            - name: MKL_NUM_THREADS
              value: {{ .threads | quote }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $cfg.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          startupProbe:
            grpc:
              port: {{ .probePort }}
            {{- toYaml $cfg.startupProbe | nindent 12 }}
          livenessProbe:
            grpc:
              port: {{ .probePort }}
            {{- toYaml $cfg.livenessProbe | nindent 12 }}
          readinessProbe:
            {{- if and .http .http.probe }}
            httpGet:
              path: /health
              port: http
              scheme: {{ .http.scheme }}
            {{- else }}
            grpc:
              port: {{ .probePort }}
            {{- end }}
            {{- toYaml $cfg.readinessProbe | nindent 12 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $cfg.preStopSleepSeconds }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: cache
              mountPath: {{ $root.Values.cache.mountPath }}
            - name: tmp
              mountPath: /tmp
            {{- with (include "specdec.modelVolumeMounts" $root | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with .mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: cache
          emptyDir:
            sizeLimit: {{ $root.Values.cache.sizeLimit }}
        - name: tmp
          emptyDir: {}
        {{- with (include "specdec.modelVolumes" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $cfg.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/*
The PodDisruptionBudget of one role. Call with (dict "root" $ "component" "draft" "cfg" .Values.draft).
*/}}
{{- define "specdec.rolePdb" -}}
{{- if .cfg.pdb.enabled }}
{{- $ctx := dict "root" .root "component" .component }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  labels:
    {{- include "specdec.componentLabels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ .cfg.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "specdec.componentSelectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}

{{/*
The Service of one role. Call with (dict "root" $ "component" "draft" "cfg" .Values.draft "headless" true).
*/}}
{{- define "specdec.roleService" -}}
{{- $ctx := dict "root" .root "component" .component }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  labels:
    {{- include "specdec.componentLabels" $ctx | nindent 4 }}
  {{- with (and (not .headless) .cfg.service .cfg.service.annotations) }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .headless }}
  type: ClusterIP
  clusterIP: None
  {{- else }}
  type: {{ .cfg.service.type }}
  {{- end }}
  ports:
    - name: grpc
      port: {{ .cfg.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if and .cfg.http .cfg.http.enabled }}
    - name: http
      port: {{ .cfg.http.port }}
      targetPort: http
      protocol: TCP
      appProtocol: {{ ternary "https" "http" (and .cfg.tls (eq .cfg.tls.enabled true)) }}
    {{- end }}
    {{- if .root.Values.serviceMonitor.enabled }}
    - name: metrics
      port: {{ .root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
  selector:
    {{- include "specdec.componentSelectorLabels" $ctx | nindent 4 }}
{{- end }}
